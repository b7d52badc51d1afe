"""Exponential moving average of the trainable parameters.

Kept on each rank's own (sharded, under FSDP) parameters, so an update costs no
communication; the full EMA weights are gathered only when a checkpoint is written.
"""
import contextlib

import torch


class ParamEMA:
    def __init__(self, model, decay):
        self.decay = decay
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.shadow = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def update(self):
        for s, p in zip(self.shadow, self.params):
            s.lerp_(p.detach(), 1.0 - self.decay)

    @contextlib.contextmanager
    @torch.no_grad()
    def swapped_in(self):
        """Temporarily put the EMA values into the model (for saving or evaluation)."""
        backup = [p.detach().clone() for p in self.params]
        for s, p in zip(self.shadow, self.params):
            p.copy_(s)
        try:
            yield
        finally:
            for b, p in zip(backup, self.params):
                p.copy_(b)

    @staticmethod
    def trainable_names(model):
        from .fsdp_util import clean_param_name
        return [clean_param_name(n) for n, p in model.named_parameters() if p.requires_grad]

    @torch.no_grad()
    def load_full_state(self, model, full_state_dict):
        """Set the EMA from a full (unsharded) state dict, e.g. a checkpoint's ema/ folder: every
        parameter, or (a LoRA run's) every trainable one."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        backup = [p.detach().clone() for p in self.params]
        options = StateDictOptions(full_state_dict=True, ignore_frozen_params=True, strict=False)
        missing = set(ParamEMA.trainable_names(model)) - set(full_state_dict)
        if missing:
            raise ValueError(f"EMA state lacks {len(missing)} trainable parameter(s), e.g. {sorted(missing)[0]}")
        set_model_state_dict(model, full_state_dict, options=options)
        for s, p, b in zip(self.shadow, self.params, backup):
            s.copy_(p)
            p.copy_(b)
