# A stand-in for Flow-GRPO's flow_grpo/diffusers_patch/sd3_sde_with_logprob.py, written from this
# repository's description of its step kernel (the "sde" type): sigma from the scheduler's index of each
# sample's timestep, g = noise_level * sqrt(sigma / (1 - sigma~)) (sigma~ = sigma, or sigmas[1] where
# sigma is 1), the mean x (1 + g^2 dt / (2 sigma)) + v (1 + g^2 (1 - sigma) / (2 sigma)) dt, the next
# latent drawn with std g sqrt(|dt|) unless given, the log-prob the per-element Gaussian MEAN over all
# but the batch dimension; everything in float32 from the model output, as upstream computes it.
import math

import torch
from diffusers.utils.torch_utils import randn_tensor


def sde_step_with_logprob(self, model_output, timestep, sample, noise_level=0.7, prev_sample=None, generator=None):
    model_output = model_output.float()
    sample = sample.float()
    if prev_sample is not None:
        prev_sample = prev_sample.float()
    step_index = [self.index_for_timestep(t) for t in timestep]
    prev_step_index = [step + 1 for step in step_index]
    sigma = self.sigmas[step_index].view(-1, *([1] * (sample.ndim - 1)))
    sigma_prev = self.sigmas[prev_step_index].view(-1, *([1] * (sample.ndim - 1)))
    sigma_max = self.sigmas[1].item()
    dt = sigma_prev - sigma
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * noise_level
    prev_sample_mean = (sample * (1 + std_dev_t ** 2 / (2 * sigma) * dt)
                        + model_output * (1 + std_dev_t ** 2 * (1 - sigma) / (2 * sigma)) * dt)
    if prev_sample is None:
        variance_noise = randn_tensor(model_output.shape, generator=generator, device=model_output.device,
                                      dtype=model_output.dtype)
        prev_sample = prev_sample_mean + std_dev_t * torch.sqrt(-1 * dt) * variance_noise
    log_prob = (-((prev_sample.detach() - prev_sample_mean) ** 2) / (2 * ((std_dev_t * torch.sqrt(-1 * dt)) ** 2))
                - torch.log(std_dev_t * torch.sqrt(-1 * dt))
                - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi))))
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    return prev_sample, log_prob, prev_sample_mean, std_dev_t
