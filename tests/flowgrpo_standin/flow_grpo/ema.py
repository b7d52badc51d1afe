# A stand-in for Flow-GRPO's flow_grpo/ema.py: an exponential moving average of the trainable
# parameters, updated every `update_step_interval` optimizer steps, swapped in for evaluation and
# checkpoints (copy_ema_to with store_temp, then copy_temp_to).
import torch


class EMAModuleWrapper:
    def __init__(self, parameters, decay=0.9, update_step_interval=8, device=None):
        parameters = list(parameters)
        self.ema_parameters = [p.detach().clone().to(device) for p in parameters]
        self.temp_stored_parameters = None
        self.decay = decay
        self.update_step_interval = update_step_interval

    @torch.no_grad()
    def step(self, parameters, optimization_step):
        if (optimization_step + 1) % self.update_step_interval != 0:
            return
        for ema, p in zip(self.ema_parameters, parameters):
            ema.mul_(self.decay).add_(p.detach().to(ema.device), alpha=1 - self.decay)

    def copy_ema_to(self, parameters, store_temp=True):
        parameters = list(parameters)
        if store_temp:
            self.temp_stored_parameters = [p.detach().clone() for p in parameters]
        with torch.no_grad():
            for ema, p in zip(self.ema_parameters, parameters):
                p.copy_(ema.to(p.device))

    def copy_temp_to(self, parameters):
        with torch.no_grad():
            for temp, p in zip(self.temp_stored_parameters, parameters):
                p.copy_(temp)
        self.temp_stored_parameters = None
