# A stand-in for upstream DanceGRPO's fastvideo/models/stable_diffusion/ddim_with_logprob.py (DDPO's DDIM step
# with its log-prob), written from this repository's description of it: prev_t = t - T/N clamped, the
# alphas gathered at t and prev_t, x0 from the predicted noise (clipped to [-1, 1] when the scheduler's
# clip_sample is set), the DDIM mean, std = eta * sqrt(variance), the Gaussian log-density of prev_sample
# averaged over all but the batch dimension.
import math

import torch


def _left_broadcast(t, shape):
    return t.reshape(t.shape + (1,) * (len(shape) - t.ndim)).broadcast_to(shape)


def _get_variance(self, timestep, prev_timestep):
    alpha_prod_t = torch.gather(self.alphas_cumprod, 0, timestep.cpu()).to(timestep.device)
    alpha_prod_t_prev = torch.where(prev_timestep.cpu() >= 0, self.alphas_cumprod.gather(0, prev_timestep.cpu()),
                                    self.final_alpha_cumprod).to(timestep.device)
    beta_prod_t = 1 - alpha_prod_t
    beta_prod_t_prev = 1 - alpha_prod_t_prev
    return (beta_prod_t_prev / beta_prod_t) * (1 - alpha_prod_t / alpha_prod_t_prev)


def ddim_step_with_logprob(self, model_output, timestep, sample, eta=0.0, use_clipped_model_output=False,
                           generator=None, prev_sample=None):
    timestep = torch.as_tensor(timestep, device=sample.device).reshape(-1)   # a 0-d t of the rollout, or [B]
    prev_timestep = timestep - self.config.num_train_timesteps // self.num_inference_steps
    prev_timestep = torch.clamp(prev_timestep, 0, self.config.num_train_timesteps - 1)
    alpha_prod_t = self.alphas_cumprod.gather(0, timestep.cpu())
    alpha_prod_t_prev = torch.where(prev_timestep.cpu() >= 0, self.alphas_cumprod.gather(0, prev_timestep.cpu()),
                                    self.final_alpha_cumprod)
    alpha_prod_t = _left_broadcast(alpha_prod_t, sample.shape).to(sample.device)
    alpha_prod_t_prev = _left_broadcast(alpha_prod_t_prev, sample.shape).to(sample.device)
    beta_prod_t = 1 - alpha_prod_t
    if self.config.prediction_type == "epsilon":
        pred_original_sample = (sample - beta_prod_t ** 0.5 * model_output) / alpha_prod_t ** 0.5
        pred_epsilon = model_output
    elif self.config.prediction_type == "sample":
        pred_original_sample = model_output
        pred_epsilon = (sample - alpha_prod_t ** 0.5 * pred_original_sample) / beta_prod_t ** 0.5
    else:   # v_prediction
        pred_original_sample = alpha_prod_t ** 0.5 * sample - beta_prod_t ** 0.5 * model_output
        pred_epsilon = alpha_prod_t ** 0.5 * model_output + beta_prod_t ** 0.5 * sample
    if self.config.clip_sample:
        pred_original_sample = pred_original_sample.clamp(-self.config.clip_sample_range,
                                                          self.config.clip_sample_range)
    variance = _get_variance(self, timestep, prev_timestep)
    std_dev_t = _left_broadcast(eta * variance ** 0.5, sample.shape).to(sample.device)
    if use_clipped_model_output:
        pred_epsilon = (sample - alpha_prod_t ** 0.5 * pred_original_sample) / beta_prod_t ** 0.5
    pred_sample_direction = (1 - alpha_prod_t_prev - std_dev_t ** 2) ** 0.5 * pred_epsilon
    prev_sample_mean = alpha_prod_t_prev ** 0.5 * pred_original_sample + pred_sample_direction
    if prev_sample is None:
        variance_noise = torch.randn(model_output.shape, generator=generator, dtype=model_output.dtype)
        prev_sample = prev_sample_mean + std_dev_t * variance_noise
    log_prob = (-((prev_sample.detach() - prev_sample_mean) ** 2) / (2 * (std_dev_t ** 2)) - torch.log(std_dev_t)
                - math.log(math.sqrt(2 * math.pi)))
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    return prev_sample.type(sample.dtype), log_prob
