"""The rollout's transition kernels, chosen by --sde_type (Flow-GRPO's and DanceGRPO's): a
registry, one class per kernel, so a new kernel is one class and one entry in KERNELS.

Every kernel maps (model output v, state x, transition k, noise level a) to a Gaussian
N(mean, std^2) over the next state; the rollout draws from it and training re-scores the stored
next state under it, so a kernel's log-prob of its own samples gives ratio exactly 1.

  dance      DanceGRPO's flux_step: std = a sqrt(sigma - sigma') (a is --eta).
  flow_grpo  Flow-GRPO's "sde": g = a sqrt(sigma / (1 - sigma~)), sigma~ = sigma except at
             sigma == 1, where Flow-GRPO takes sigmas[1]; std = g sqrt(|dt|).
  cps        Flow-GRPO's coefficient-preserving kernel: s = sigma' sin(a pi / 2), mean =
             (1 - sigma') x0_hat + sqrt(sigma'^2 - s^2) x1_hat, std = s; its log-prob is the
             UNSCALED -mean((x' - mean)^2), as Flow-GRPO (no 1/(2 s^2), no constants).

`kl_scale` is Flow-GRPO's std_dev_t, the divisor of its KL term: g (flow_grpo, without |dt|),
s (cps), the step std (dance).
"""
import math

import torch

from .sde import _per_sample, at_least_fp32, flux_step, gaussian_log_prob, step_sigmas, step_std


def _sigmas_at(sigmas, index, like):
    sigma, sigma_next = sigmas[index], sigmas[index + 1]
    if torch.is_tensor(index) and index.ndim > 0:
        return _per_sample(sigma, like), _per_sample(sigma_next, like)
    return sigma.to(like.dtype), sigma_next.to(like.dtype)


class Kernel:
    """A transition kernel: `gaussian` gives (mean, std, kl_scale) of the next state from x at
    transition `index` (int or [B]); `log_prob` scores a next state under it; `step` draws one
    (prev_sample None) or re-scores prev_sample."""

    def gaussian(self, v, x, a, sigmas, index):
        raise NotImplementedError

    def log_prob(self, sample, mean, std):
        return gaussian_log_prob(sample, mean, std)

    def step(self, v, x, a, sigmas, index, prev_sample=None, generator=None):
        mean, std, _ = self.gaussian(at_least_fp32(v), at_least_fp32(x), a, sigmas, index)
        if prev_sample is None:
            noise = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
            prev_sample = mean + noise * std
        return prev_sample, self.log_prob(prev_sample, mean, std)

    def draw(self, v, x, a, sigmas, index, noise):
        """(next state, log-prob) with the given standard-normal noise (drawn elsewhere: one generator
        per sample in evaluation)."""
        mean, std, _ = self.gaussian(at_least_fp32(v), at_least_fp32(x), a, sigmas, index)
        sample = mean + noise.to(mean) * std
        return sample, self.log_prob(sample, mean, std)


class Dance(Kernel):
    """DanceGRPO's: its step is upstream's flux_step itself, bit for bit."""

    def gaussian(self, v, x, a, sigmas, index):
        mean, _ = flux_step(v, x, a, sigmas, index, grpo=False, sde_solver=True)
        sigma, sigma_next = _sigmas_at(sigmas, index, x)
        std = a * torch.sqrt(sigma - sigma_next)
        return mean, std, std

    def step(self, v, x, a, sigmas, index, prev_sample=None, generator=None):
        next_x, _, logp = flux_step(v, at_least_fp32(x), a, sigmas, index, prev_sample=prev_sample, grpo=True,
                                    sde_solver=True, generator=generator)
        return next_x, logp

    def draw(self, v, x, a, sigmas, index, noise):
        """As step's draw, the noise given: flux_step's mean and its own noise scale."""
        x = at_least_fp32(x)
        mean, _ = flux_step(v, x, a, sigmas, index, grpo=False, sde_solver=True)
        sample = mean + noise.to(mean) * step_std(a, *step_sigmas(sigmas, index, x))
        return self.step(v, x, a, sigmas, index, prev_sample=sample)


class FlowGRPO(Kernel):
    def gaussian(self, v, x, a, sigmas, index):
        sigma, sigma_next = _sigmas_at(sigmas, index, x)
        dt = sigma_next - sigma
        sigma_tilde = torch.where(sigma == 1, sigmas[1].to(x.dtype), sigma)
        g = a * torch.sqrt(sigma / (1 - sigma_tilde))
        mean = x * (1 + g ** 2 * dt / (2 * sigma)) + v * (1 + g ** 2 * (1 - sigma) / (2 * sigma)) * dt
        return mean, g * torch.sqrt(-dt), g


class CPS(Kernel):
    def gaussian(self, v, x, a, sigmas, index):
        sigma, sigma_next = _sigmas_at(sigmas, index, x)
        s = sigma_next * math.sin(a * math.pi / 2)
        x0_hat, x1_hat = x - sigma * v, x + (1 - sigma) * v
        mean = (1 - sigma_next) * x0_hat + torch.sqrt(sigma_next ** 2 - s ** 2) * x1_hat
        return mean, s, s

    def log_prob(self, sample, mean, std):
        diff = at_least_fp32(sample.detach()) - mean
        return -(diff ** 2).mean(dim=tuple(range(1, diff.ndim)))


KERNELS = {"dance": Dance(), "flow_grpo": FlowGRPO(), "cps": CPS()}
SDE_TYPES = tuple(KERNELS)   # the same as dancegrpo.choices.SDE_TYPES, which the parser offers


def get_kernel(sde_type):
    try:
        return KERNELS[sde_type]
    except KeyError:
        raise ValueError(f"--sde_type must be one of {SDE_TYPES}, got {sde_type!r}") from None


def kernel(sde_type, v, x, a, sigmas, index):
    """(mean, std, kl_scale) of the transition from x at transition `index` (int or [B])."""
    return get_kernel(sde_type).gaussian(at_least_fp32(v), at_least_fp32(x), a, sigmas, index)


def sde_transition(sde_type, v, x, a, sigmas, index, prev_sample=None, generator=None):
    """(next state, log-prob): a draw when prev_sample is None, else a re-score of prev_sample.

    A re-score with per-sample transitions (index [B]) runs the kernel once per distinct transition
    with an int index on the rows that take it: the same arithmetic as the rollout's draw, which
    takes an int index. With bf16 model outputs, per-sample sigma tensors would round flux_step's
    sigma * v products differently (float32 instead of bf16) and the on-policy ratio would not be 1."""
    if prev_sample is not None and torch.is_tensor(index) and index.ndim > 0:
        return per_transition(index, lambda k, rows: sde_transition(sde_type, v[rows], x[rows], a, sigmas, k,
                                                                   prev_sample[rows]))
    return get_kernel(sde_type).step(v, x, a, sigmas, index, prev_sample, generator)


def per_transition(index, step):
    """step(k, rows) for each distinct transition k in `index` [B] on the rows that take it (k an
    int); the tuples it returns are put back together in row order."""
    values = index.unique()
    if values.numel() == 1:
        return step(int(values), slice(None))
    parts, order = [], []
    for k in values.tolist():
        rows = (index == k).nonzero().flatten()
        parts.append(step(k, rows))
        order.append(rows)
    inverse = torch.argsort(torch.cat(order))
    return tuple(torch.cat(part)[inverse] for part in zip(*parts))


def ode_transition(v, x, sigmas, index):
    """Deterministic Euler, x' = x + (sigma' - sigma) v: the steps outside a Flow-GRPO-Fast window
    (flux_step without the SDE, as the sample grids and evaluation sample)."""
    return flux_step(at_least_fp32(v), at_least_fp32(x), 0.0, sigmas, index, grpo=False, sde_solver=False)[0]
