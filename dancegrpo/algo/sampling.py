"""The one denoising loop: S transitions of a flow-matching model from noise, each through a
transition kernel. The rollout, the sample grids, evaluation and the digits build all sample
with `denoise`, each with its kernel:

    ode(sigmas)                                 deterministic Euler (grids, evaluation, the build)
    sde(sde_type, eta, sigmas, generator)       a kernel of KERNELS, drawn with one generator
                                                (the rollout; the build's SDE rate)
    sde_per_sample(sde_type, eta, sigmas, gens) the same kernel, each sample's noise from its own
                                                generator (evaluation: an image's noise does not
                                                depend on the batch it is in)
    windowed(inside, outside, window)           `inside` at transitions first..end-1, `outside`
                                                elsewhere (Flow-GRPO-Fast's SDE window)

A kernel is a function (i, v, z) -> (next z, log-prob [B] or None for a deterministic step).
"""
from dataclasses import dataclass

import torch

from .kernels import get_kernel, ode_transition, sde_transition
from .sde import at_least_fp32


@dataclass
class Trajectory:
    x0: torch.Tensor              # the x0 estimate of the last transition, z - sigma v (what is decoded)
    latents: torch.Tensor = None  # [B, S+1, L, C], the state before each transition and the last one
    log_probs: torch.Tensor = None   # [B, S], 0 where the step was deterministic
    outputs: torch.Tensor = None  # [B, S, L, C] the model output at each transition


def ode(sigmas):
    def step(i, v, z):
        return ode_transition(v, z, sigmas, i), None
    return step


def sde(sde_type, eta, sigmas, generator):
    def step(i, v, z):
        return sde_transition(sde_type, v, z, eta, sigmas, i, generator=generator)
    return step


def sde_per_sample(sde_type, eta, sigmas, generators):
    """The kernel's draw, each row's noise drawn on the CPU with its own generator."""
    def step(i, v, z):
        noise = torch.stack([torch.randn(z.shape[1:], generator=g) for g in generators])
        return get_kernel(sde_type).draw(v, z, eta, sigmas, i, noise)
    return step


def windowed(inside, outside, window):
    """`inside` at the transitions of window = (first, end), `outside` at the others; window None:
    `inside` everywhere."""
    if window is None:
        return inside

    def step(i, v, z):
        return (inside if window[0] <= i < window[1] else outside)(i, v, z)
    return step


def denoise(predict, z, sigmas, timesteps, step, keep=False):
    """Run every transition from the noise z: v = predict(z, t [B]); z = step(i, v, z)[0].
    keep: also the latents, log-probs and model outputs of the whole trajectory."""
    latents, log_probs, outputs = [z], [], []
    x0 = z
    for i in range(sigmas.numel() - 1):
        v = predict(z, timesteps[i].expand(z.shape[0]).to(z.device))
        x0 = at_least_fp32(z) - float(sigmas[i]) * v   # flux_step's pred_original_sample
        z, log_prob = step(i, v, z)
        if keep:
            latents.append(z)
            log_probs.append(torch.zeros(z.shape[0], device=z.device) if log_prob is None else log_prob)
            outputs.append(v)
    if not keep:
        return Trajectory(x0)
    return Trajectory(x0, torch.stack(latents, dim=1), torch.stack(log_probs, dim=1), torch.stack(outputs, dim=1))
