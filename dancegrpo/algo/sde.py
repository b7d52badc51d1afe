"""Flow-matching schedule and the SDE transition used by DanceGRPO.

The rollout samples x_{k+1} ~ N(mean_k(v), std_k^2) and training re-scores the stored
x_{k+1} under the current policy. Both go through `flux_step` with an int transition index, so
with sigma and sigma' as Python-float scalars (`kernels.sde_transition` splits a re-score of
per-sample transitions by transition): the arithmetic is the same, and the ratio is exactly 1
before any update, bf16 model outputs included (sigma * v then rounds to bf16 in both, as
upstream's 0-d float32 sigmas do). Called directly with a LongTensor index, flux_step takes
per-sample sigma tensors of the latents' dtype, whose products with a bf16 v are float32.
"""
import math

import torch


def sd3_time_shift(shift, t):
    """SD3 / Flux resolution shift of a time grid: s*t / (1 + (s-1)*t)."""
    return (shift * t) / (1 + (shift - 1) * t)


def sigma_schedule(sampling_steps, shift):
    """S+1 shifted sigmas from 1 down to 0 (float32, as upstream)."""
    return sd3_time_shift(shift, torch.linspace(1, 0, sampling_steps + 1))


def model_timesteps(sigmas):
    """Timesteps the transformer sees: int(sigma * 1000) / 1000 per transition.

    Upstream multiplies a float32 sigma by 1000 IN FLOAT32 and truncates; in double precision
    the product truncates one lower at some steps (S 16, shift 3: 899 / 699 instead of 900 /
    700), so the product is taken in float32 here too and curves match upstream's.
    """
    products = sigmas[:-1].to(torch.float32) * 1000
    return torch.trunc(products) / 1000


def at_least_fp32(x):
    """float32 for half/bf16/fp32 inputs (upstream's log-prob precision); float64 stays float64."""
    return x if x.dtype == torch.float64 else x.float()


def _per_sample(value, like):
    """Broadcast a scalar or per-sample [B] value against a [B, ...] tensor."""
    if not torch.is_tensor(value) or value.ndim == 0:
        return value
    return value.reshape(-1, *([1] * (like.ndim - 1))).to(device=like.device, dtype=like.dtype)


def step_sigmas(sigmas, index, latents):
    """(sigma, sigma') of transition `index` as flux_step computes with them: Python floats for an int
    index (upstream's arithmetic), per-sample tensors like `latents` for a LongTensor [B]."""
    sigma, sigma_next = sigmas[index], sigmas[index + 1]
    if torch.is_tensor(index) and index.ndim > 0:
        return _per_sample(sigma, latents), _per_sample(sigma_next, latents)
    return float(sigma), float(sigma_next)


def step_std(eta, sig, sig_next):
    """flux_step's noise scale eta sqrt(sigma - sigma') (sigmas from step_sigmas)."""
    return eta * ((sig - sig_next) ** 0.5 if torch.is_tensor(sig) else math.sqrt(sig - sig_next))


def flux_step(model_output, latents, eta, sigmas, index, prev_sample=None, grpo=True, sde_solver=True,
              generator=None):
    """One denoising transition of the flow-matching SDE.

    `index` is an int or a LongTensor [B] (one transition per sample). Returns
    (prev_sample, pred_original_sample, log_prob) when `grpo`, else
    (prev_sample_mean, pred_original_sample). log_prob is the MEAN over all
    non-batch elements of the Gaussian log-density, computed in float32.
    """
    sig, sig_next = step_sigmas(sigmas, index, latents)
    dsigma = sig_next - sig  # negative: sigma decreases while denoising

    pred_original_sample = latents - sig * model_output
    mean = latents + dsigma * model_output
    if sde_solver:
        # Score of the marginal implied by x0_hat; turns the ODE drift into the SDE drift.
        score = -(latents - (1 - sig) * pred_original_sample) / sig ** 2
        mean = mean + (-0.5 * eta ** 2 * score) * dsigma
    std = step_std(eta, sig, sig_next)

    if not grpo:
        return mean, pred_original_sample
    if prev_sample is None:
        noise = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
        prev_sample = mean + noise * std
    log_prob = gaussian_log_prob(prev_sample, mean, std)
    return prev_sample, pred_original_sample, log_prob


def gaussian_log_prob(sample, mean, std):
    """Per-sample mean over elements of log N(sample; mean, std^2), in float32 (or float64)."""
    std32 = at_least_fp32(std) if torch.is_tensor(std) else std
    log_std = torch.log(std32) if torch.is_tensor(std32) else math.log(std32)
    diff = at_least_fp32(sample.detach()) - at_least_fp32(mean)
    log_prob = -diff ** 2 / (2 * std32 ** 2) - log_std - 0.5 * math.log(2 * math.pi)
    return log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
