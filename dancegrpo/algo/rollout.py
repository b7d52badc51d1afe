"""The rollout: one step's trajectories of the current policy, sampled without grad, decoded
and scored. Upstream's names (`run_sample_step`, `sample_reference_model`) are kept.

Every random draw comes from per (seed, step, rank) generators, so a resumed run samples
what the original would have."""
from dataclasses import dataclass

import torch

from ..utils.precision import compute_autocast
from .sampling import denoise, ode, sde, windowed


@dataclass
class Rollout:
    """One step's trajectories. latents[b, k] is the state before transition k (k = 0..S)."""
    latents: torch.Tensor     # [B, S+1, L, C] float32
    log_probs: torch.Tensor   # [B, S] float32, log-prob of each transition under the sampling policy
    images: list
    rewards: torch.Tensor     # [B] float32
    # [B, S, L, C] the model output at each transition, kept only for a policy update that reuses
    # it (grpo.wants_rollout_outputs); None otherwise.
    outputs: torch.Tensor = None
    # [B] first transition of each sample's SDE window (--sde_window_size > 0; ODE elsewhere, and
    # log_probs 0 there); None: the SDE at every transition.
    window_start: torch.Tensor = None


def step_generators(ctx, step):
    """Per (seed, step, rank) generators, so a resumed run draws what the original would have."""
    base = (ctx.seed * 1_000_003 + step) * 1009 + ctx.rank
    noise = torch.Generator(device=ctx.device).manual_seed(base % 2 ** 63)
    host = torch.Generator().manual_seed((base + 7) % 2 ** 63)
    return noise, host


def predict_velocity(ctx, latents, timesteps, cond):
    """The policy's output under --mixed_precision's autocast (utils.precision.compute_autocast; under
    FSDP with bf16 MixedPrecision, Qwen-Image on GPU, the parameters are bf16 as well)."""
    with compute_autocast(ctx.device, ctx.args.mixed_precision):
        return ctx.family.predict(ctx.transformer, latents, timesteps, cond)


def run_sample_step(ctx, z, cond, generator, window=None):
    """Roll one chunk of samples through all S transitions (no grad): the --sde_type kernel at
    every transition, or only inside `window` = (first, end) with deterministic Euler outside
    (Flow-GRPO-Fast; the log-prob of an ODE transition is stored as 0 and never trained).

    Returns (x0_hat of the last step, all latents [B, S+1, L, C], log-probs [B, S], model
    outputs [B, S, L, C]).
    """
    args = ctx.args
    step = windowed(sde(args.sde_type, args.eta, ctx.sigmas, generator), ode(ctx.sigmas), window)
    traj = denoise(lambda x, t: predict_velocity(ctx, x, t, cond), z, ctx.sigmas, ctx.timesteps, step, keep=True)
    return traj.x0, traj.latents, traj.log_probs, traj.outputs


def window_generator(ctx):
    """Per (seed, step, rank) generator of the SDE window starts: every rank and step draws its
    own, and a resumed run draws what the original drew (upstream's Qwen trainer reseeded with
    the rank on every call, so its window never moved: not reproduced)."""
    base = ((ctx.seed * 1_000_003 + ctx.step) * 1009 + ctx.rank) * 31 + 17
    return torch.Generator().manual_seed(base % 2 ** 63)


def draw_window(args, generator):
    """(first, end) of one sampling batch's SDE window: first uniform in [a, b - K], as
    Flow-GRPO's random.randint(a, b - K); None without --sde_window_size."""
    size = args.sde_window_size
    if not size:
        return None
    low, high = args.sde_window_range
    first = int(torch.randint(low, high - size + 1, (1,), generator=generator))
    return first, first + size


def initial_latents(ctx, num_samples, generator):
    """Initial noise; with --init_same_noise one draw per prompt group (upstream shared one
    draw across all prompts on a rank, a bug)."""
    args = ctx.args
    if args.init_same_noise and args.use_group:
        per_prompt = ctx.family.initial_noise(num_samples // args.num_generations, generator, ctx.device)
        return per_prompt.repeat_interleave(args.num_generations, dim=0)
    return ctx.family.initial_noise(num_samples, generator, ctx.device)


@torch.no_grad()
def sample_reference_model(ctx, cond, captions, generator, keep_outputs=False):
    """Rollouts of the current policy, decoded and scored. One transformer call per
    chunk of --sample_batch_size samples and step. keep_outputs: also keep the model outputs."""
    ctx.transformer.eval()
    z0 = initial_latents(ctx, len(captions), generator)
    latents, log_probs, outputs, images, starts = [], [], [], [], []
    windows = window_generator(ctx)
    for start in range(0, len(captions), ctx.args.sample_batch_size):
        sl = slice(start, start + ctx.args.sample_batch_size)
        window = draw_window(ctx.args, windows)   # one per sampling batch, as Flow-GRPO-Fast
        x0, chunk_latents, chunk_log_probs, chunk_outputs = run_sample_step(
            ctx, z0[sl], {k: v[sl] for k, v in cond.items()}, generator, window)
        if window is not None:
            starts.append(torch.full((chunk_latents.shape[0],), window[0], dtype=torch.long, device=ctx.device))
        latents.append(chunk_latents)
        log_probs.append(chunk_log_probs)
        if keep_outputs:
            outputs.append(chunk_outputs)
        del chunk_outputs
        images.extend(ctx.family.decode(ctx.vae, x0))
    rewards = ctx.reward_fn(images, captions).to(ctx.device)
    return Rollout(torch.cat(latents), torch.cat(log_probs), images, rewards,
                   torch.cat(outputs) if keep_outputs else None, torch.cat(starts) if starts else None)


def expand_groups(args, batch):
    """Repeat each prompt --num_generations times in contiguous blocks (with --use_group)."""
    captions = list(batch["caption"])
    cond = {k: v for k, v in batch.items() if k != "caption"}
    if args.use_group:
        cond = {k: v.repeat_interleave(args.num_generations, dim=0) for k, v in cond.items()}
        captions = [c for c in captions for _ in range(args.num_generations)]
    return cond, captions
