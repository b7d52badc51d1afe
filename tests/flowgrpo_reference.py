"""An independent float64 reference of Flow-GRPO's SD3 update (GRPO_LOOPS.md section 2, FLOWGRPO.md
section 1), written out here: nothing of the stand-in nor of jagg_patch is used.

From what a run recorded (each grad-mode update call's batch of samples, its step j and its conditioning;
the model's output leaf and the signal the stand-in's loss put on it), it computes
- `signal_of`: the upstream gradient dL/d(model output) of one call, from the sde kernel, the guidance
  with the uncond half detached, the PPO loss, the KL term against the base model (peft's
  disable_adapter), divided by accelerate's accumulation (GA x trained steps), all in float64;
- `labels_of`: which trajectory (batch, row, half) and step each row of each call is;
- the gradients then come from tests/deferred_loops.jagg_reference: every row backpropagated with its
  own signal (mode exact: vanilla), or each trajectory's rows folded onto their endpoints (JAGG).
"""
import math

import torch

DT = torch.float64


def scheduler_sigmas(num_steps):
    """(timesteps, sigmas) of SD3's flow-matching schedule (shift 3), as diffusers sets them."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(num_steps)
    return scheduler.timesteps.tolist(), [float(s) for s in scheduler.sigmas]


def sde_mean_log_prob(x, v, t, prev, noise_level, timesteps, sigmas):
    """Per row: the sde kernel's mean, its Gaussian log-prob of `prev` (mean over the row's elements) and g,
    float64, written from FLOWGRPO.md section 1."""
    means, log_probs, gs = [], [], []
    for r in range(x.shape[0]):
        k = timesteps.index(float(t[r]))
        sigma, sigma_next = sigmas[k], sigmas[k + 1]
        dt = sigma_next - sigma
        tilde = sigmas[1] if sigma == 1 else sigma
        g = noise_level * math.sqrt(sigma / (1 - tilde))
        mean = x[r] * (1 + g * g * dt / (2 * sigma)) + v[r] * (1 + g * g * (1 - sigma) / (2 * sigma)) * dt
        std = g * math.sqrt(-dt)
        log_prob = -((prev[r] - mean) ** 2) / (2 * std * std) - math.log(std) - 0.5 * math.log(2 * math.pi)
        means.append(mean)
        log_probs.append(log_prob.mean())
        gs.append(g)
    return torch.stack(means), torch.stack(log_probs), torch.tensor(gs, dtype=DT)


def guided(out, cfg, guidance, rows):
    if not cfg:
        return out
    uncond, cond = out[:rows].detach(), out[rows:]
    return uncond + guidance * (cond - uncond)


def loss_of(out, sample, j, c, timesteps, sigmas, reference_out=None):
    """The loss of one update call (before accelerate divides it), from the model's output `out`."""
    rows = sample["latents"].shape[0]
    x, t = sample["latents"][:, j].to(DT), sample["timesteps"][:, j]
    prev, old = sample["next_latents"][:, j].to(DT), sample["log_probs"][:, j].to(DT)
    v = guided(out.to(DT), c.cfg, c.guidance, rows)
    mean, log_prob, g = sde_mean_log_prob(x, v, t, prev, c.noise_level, timesteps, sigmas)
    a = sample["advantages"][:, j].to(DT).clamp(-c.adv_clip_max, c.adv_clip_max)
    ratio = torch.exp(log_prob - old)
    loss = torch.maximum(-a * ratio, -a * ratio.clamp(1 - c.clip_range, 1 + c.clip_range)).mean()
    if c.beta > 0:
        v_ref = guided(reference_out.to(DT), c.cfg, c.guidance, rows)
        mean_ref = sde_mean_log_prob(x, v_ref, t, prev, c.noise_level, timesteps, sigmas)[0]
        per_row = ((mean - mean_ref) ** 2).reshape(rows, -1).mean(dim=1) / (2 * g ** 2)
        loss = loss + c.beta * per_row.mean()
    return loss


def call_args(sample, j, embeds, pooled, cfg):
    x, t = sample["latents"][:, j], sample["timesteps"][:, j]
    if cfg:
        x, t = torch.cat([x, x]), torch.cat([t, t])
    return dict(hidden_states=x, timestep=t, encoder_hidden_states=embeds, pooled_projections=pooled)


def signal_of(model, record, c, accumulation, timesteps, sigmas):
    """dL/d(output) of one recorded call, float64; `model` the PeftModel (the reference policy is the same
    model with its adapter disabled)."""
    sample, j, embeds, pooled = record
    args = call_args(sample, j, embeds, pooled, c.cfg)
    with torch.no_grad():
        out = model(**args, return_dict=False)[0]
        reference_out = None
        if c.beta > 0:
            with model.disable_adapter():
                reference_out = model(**args, return_dict=False)[0]
    leaf = out.detach().to(DT).requires_grad_(True)
    loss = loss_of(leaf, sample, j, c, timesteps, sigmas, reference_out) / accumulation
    return torch.autograd.grad(loss, leaf)[0]


def labels_of(records, cfg):
    """(trajectory, half, step) of every row of every recorded call: a new batch starts at j == 0."""
    out, batch = [], -1
    for sample, j, _, _ in records:
        batch += j == 0
        rows = sample["latents"].shape[0]
        halves = [(r, 0) for r in range(rows)] + [(r, 1) for r in range(rows)] if cfg else [(r, 1) for r in range(rows)]
        out.append([((batch, r), half, j) for r, half in halves])
    return out


def sd3_row(args, kwargs, r):
    """The SD3 transformer's arguments for row r of a call (every argument is per row)."""
    bound = dict(kwargs)
    return {k: bound[k][r:r + 1] for k in ("hidden_states", "timestep", "encoder_hidden_states", "pooled_projections")}
