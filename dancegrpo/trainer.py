"""The DanceGRPO training loop shared by every model family.

Upstream's names are kept (`run_sample_step`, `sample_reference_model`,
`grpo_one_step`, `train_one_step`) so that an upstream change can be ported by
reading both side by side. Model specifics live in `dancegrpo.models`; the
per-sample policy update is the seam `dancegrpo.grpo.policy_update`, which the
trainer modules pass in by name so it can be patched at run time.
"""
import os
import time
import uuid
from dataclasses import dataclass, field

import torch

from . import checkpoint as ckpt, samples
from .data import PromptEmbeddingDataset, collate_prompts, infinite_prompt_batches
from .distributed import (all_reduce_max, all_reduce_mean, apply_activation_checkpointing, clip_grad_norm,
                          decide_on_rank0, gather_tensor, init_distributed, is_distributed, resolve_weight_type,
                          shutdown, wrap_fsdp)
from .ema import ParamEMA
from .engine_deepspeed import DeepSpeedRun
from .lora import LoraWeights, add_lora
from .errors import Interrupted
from .finite import require_finite
from .grpo import (ADVANTAGES, UpdateBatch, UpdateStats, num_train_timesteps, ppo_clip_loss,
                   select_train_steps as vanilla_selection, wants_rollout_outputs, window_train_steps)
from .memory import ActivationMeter, cuda_peak_mb, cuda_peak_reset
from .metrics import MetricsWriter, PassCounter
from .models.base import compute_autocast
from .plots import moving_average, plot_reward_curves
from .reference import Reference, frozen_copy
from .rewards import WeightedReward
from .resume import plan_run, tool_plan
from .run_config import snapshot
from .sde import at_least_fp32, model_timesteps, sigma_schedule
from .sde_kernels import kernel, ode_transition, sde_transition
from .signals import StopRequest, signal_name
from .state_memory import describe_bytes, per_rank_bytes


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


@dataclass
class TrainContext:
    """Everything a training step needs; built once by `setup`."""
    args: object
    family: object
    transformer: torch.nn.Module      # possibly FSDP-wrapped
    raw_transformer: torch.nn.Module  # the diffusers model inside
    vae: torch.nn.Module
    reward_fn: object
    optimizer: object
    lr_scheduler: object
    loader: object
    device: torch.device
    counter: PassCounter
    sigmas: torch.Tensor
    timesteps: torch.Tensor
    rank: int = 0
    world_size: int = 1
    seed: int = 0
    ema: object = None
    engine: object = None             # engine_deepspeed.DeepSpeedRun under --engine deepspeed
    step: int = 0
    activation_meter: ActivationMeter = field(default_factory=ActivationMeter)
    extra: dict = field(default_factory=dict)


def autocast(args, device):
    """--mixed_precision's autocast (models.base.compute_autocast). Under FSDP with bf16
    MixedPrecision (Qwen-Image on GPU) the parameters are bf16 as well."""
    return compute_autocast(device, args.mixed_precision)


def step_generators(ctx, step):
    """Per (seed, step, rank) generators, so a resumed run draws what the original would have."""
    base = (ctx.seed * 1_000_003 + step) * 1009 + ctx.rank
    noise = torch.Generator(device=ctx.device).manual_seed(base % 2 ** 63)
    host = torch.Generator().manual_seed((base + 7) % 2 ** 63)
    return noise, host


def predict_velocity(ctx, latents, timesteps, cond):
    with autocast(ctx.args, ctx.device):
        return ctx.family.predict(ctx.transformer, latents, timesteps, cond)


def run_sample_step(ctx, z, cond, generator, window=None):
    """Roll one chunk of samples through all S transitions (no grad): the --sde_type kernel at
    every transition, or only inside `window` = (first, end) with deterministic Euler outside
    (Flow-GRPO-Fast; the log-prob of an ODE transition is stored as 0 and never trained).

    Returns (x0_hat of the last step, all latents [B, S+1, L, C], log-probs [B, S], model
    outputs [B, S, L, C]).
    """
    args = ctx.args
    all_latents, all_log_probs, all_outputs = [z], [], []
    for i in range(ctx.sigmas.numel() - 1):
        t = ctx.timesteps[i].expand(z.shape[0]).to(z.device)
        v = predict_velocity(ctx, z, t, cond)
        x0 = at_least_fp32(z) - float(ctx.sigmas[i]) * v   # flux_step's pred_original_sample
        if window is None or window[0] <= i < window[1]:
            z, log_prob = sde_transition(args.sde_type, v, z, args.eta, ctx.sigmas, i, generator=generator)
        else:
            z, log_prob = ode_transition(v, z, ctx.sigmas, i), torch.zeros(z.shape[0], device=z.device)
        all_latents.append(z)
        all_log_probs.append(log_prob)
        all_outputs.append(v)
    return x0, torch.stack(all_latents, dim=1), torch.stack(all_log_probs, dim=1), torch.stack(all_outputs, dim=1)


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


def transition_log_prob(ctx, v, latents, next_latents, index):
    """log p(next_latents | latents) under the policy whose output is v (the --sde_type kernel;
    dance: upstream's flux_step, grpo=True)."""
    return sde_transition(ctx.args.sde_type, v, latents, ctx.args.eta, ctx.sigmas, index,
                          prev_sample=at_least_fp32(next_latents))[1]


def kl_to_reference(ctx, v, latents, index, cond):
    """Flow-GRPO's KL term per sample: mean((mu_theta - mu_ref)^2) / (2 kl_scale^2), mu the
    kernel's mean under the policy (v, with grad) and under the reference (base weights, no grad)."""
    with torch.no_grad():
        v_ref = ctx.extra["reference"](latents, ctx.timesteps[index].to(latents.device), cond)
    mean, _, scale = kernel(ctx.args.sde_type, v, latents, ctx.args.eta, ctx.sigmas, index)
    mean_ref = kernel(ctx.args.sde_type, v_ref, latents, ctx.args.eta, ctx.sigmas, index)[0]
    per_element = (mean - mean_ref) ** 2 / (2 * scale ** 2)
    return per_element.mean(dim=tuple(range(1, per_element.ndim)))


def grpo_one_step(ctx, rollout, cond, sample_idx, index):
    """New log-prob of transition index[i] of sample sample_idx[i] (forward with grad)."""
    z = rollout.latents[sample_idx, index]
    v = predict_velocity(ctx, z, ctx.timesteps[index].to(z.device), cond)
    return transition_log_prob(ctx, v, z, rollout.latents[sample_idx, index + 1], index)


def make_update_batch(ctx, rollout, cond, advantages, sample_idx, steps, normaliser, on_policy=False):
    """Closures over one micro-batch: what `policy_update` works with. on_policy: no optimizer
    step since the rollout (see UpdateBatch)."""
    args = ctx.args
    cond_m = {k: v[sample_idx] for k, v in cond.items()}

    def predict(k):
        return predict_velocity(ctx, rollout.latents[sample_idx, k], ctx.timesteps[k].to(ctx.device), cond_m)

    def predict_batched(ks):
        latents = torch.cat([rollout.latents[sample_idx, k] for k in ks])
        timesteps = torch.cat([ctx.timesteps[k].to(ctx.device) for k in ks])
        stacked = {key: value.repeat(len(ks), *([1] * (value.ndim - 1))) for key, value in cond_m.items()}
        return list(predict_velocity(ctx, latents, timesteps, stacked).split(len(sample_idx)))

    def step_loss(k, v):
        log_prob = transition_log_prob(ctx, v, rollout.latents[sample_idx, k], rollout.latents[sample_idx, k + 1], k)
        per_sample = ppo_clip_loss(log_prob, rollout.log_probs[sample_idx, k], advantages[sample_idx],
                                   args.clip_range, args.adv_clip_max)
        if args.kl_beta > 0:
            per_sample = per_sample + args.kl_beta * kl_to_reference(ctx, v, rollout.latents[sample_idx, k], k, cond_m)
        # Upstream averages over a batch of one and divides by GA * train_timesteps;
        # summing over the micro-batch keeps that gradient for any batching.
        return per_sample.sum() / normaliser

    def subset(rows):
        return make_update_batch(ctx, rollout, cond, advantages, sample_idx[rows], steps[rows], normaliser,
                                 on_policy)

    def rollout_output(k):
        return rollout.outputs[sample_idx, k]

    return UpdateBatch(predict=predict, step_loss=step_loss, steps=steps, timesteps=ctx.timesteps, subset=subset,
                       backward=ctx.engine.backward if ctx.engine is not None else None,
                       rollout_output=rollout_output if rollout.outputs is not None else None, on_policy=on_policy,
                       predict_batched=predict_batched)


def compute_advantages(ctx, rewards, all_rewards, host_gen):
    """The --advantage rule (grpo.ADVANTAGES); with --shuffle_advantages randomly permuted."""
    args = ctx.args
    adv = ADVANTAGES[args.advantage](rewards, all_rewards, args)
    if args.shuffle_advantages:  # control: same magnitudes, no relation to the samples
        adv = adv[torch.randperm(adv.numel(), generator=host_gen).to(adv.device)]
    return adv


def accumulate_policy_gradient(ctx, rollout, cond, advantages, sample_idx, steps, normaliser, policy_update,
                               on_policy=False):
    """Backpropagate the samples `sample_idx` in micro-batches of --update_batch_size
    through the seam; gradients add up in the parameters."""
    stats = UpdateStats()
    for start in range(0, len(sample_idx), ctx.args.update_batch_size):
        idx = sample_idx[start:start + ctx.args.update_batch_size]
        stats += policy_update(make_update_batch(ctx, rollout, cond, advantages, idx, steps[idx], normaliser,
                                                 on_policy))
    return stats


@dataclass
class PreparedUpdate:
    """One rollout made ready for the policy update: what the loop and every jagg_patch tool
    update from (`prepare_update`)."""
    cond: dict
    captions: list
    rollout: Rollout
    all_rewards: torch.Tensor   # every rank's rewards
    advantages: torch.Tensor
    selection: object           # grpo.TrainSelection, steps on the device
    normaliser: int             # each transition's loss is divided by it: GA * selection.num_train
    selection_rng: torch.Tensor  # the host generator's state before the selection (to draw another one)


def train_selection(ctx, rollout, host_gen, select_train_steps=vanilla_selection):
    """The transitions each sample trains: its SDE window under --sde_window_size (whatever the
    fraction, as Flow-GRPO-Fast), else what the `select_train_steps` seam draws."""
    num_samples, num_transitions = rollout.log_probs.shape[0], rollout.log_probs.shape[1] - 1  # last dropped
    if rollout.window_start is not None:
        selection = window_train_steps(rollout.window_start.cpu(), ctx.args.sde_window_size)
    else:
        selection = select_train_steps(num_samples, num_transitions, ctx.args.timestep_fraction, host_gen)
    selection.steps = selection.steps.to(ctx.device)
    return selection


def prepare_update(ctx, select_train_steps=vanilla_selection, keep_outputs=False, step=None):
    """A training step's data, rollout, rewards (gathered over ranks), advantages and trained
    transitions, drawn with the generators of training step `step` (default ctx.step) in the
    loop's order; keep_outputs: the rollout keeps its model outputs (see grpo.wants_rollout_outputs)."""
    args = ctx.args
    noise_gen, host_gen = step_generators(ctx, ctx.step if step is None else step)
    cond, captions = expand_groups(args, next(ctx.loader))
    cond = {k: v.to(ctx.device) for k, v in cond.items()}
    rollout = sample_reference_model(ctx, cond, captions, noise_gen, keep_outputs=keep_outputs)
    all_rewards = gather_tensor(rollout.rewards)
    require_finite("reward", all_rewards, ctx.step, ctx.device)
    require_finite("rollout log-prob", rollout.log_probs, ctx.step, ctx.device)
    advantages = compute_advantages(ctx, rollout.rewards, all_rewards, host_gen)
    require_finite("advantage", advantages, ctx.step, ctx.device)
    selection_rng = host_gen.get_state()
    selection = train_selection(ctx, rollout, host_gen, select_train_steps)
    return PreparedUpdate(cond, captions, rollout, all_rewards, advantages, selection,
                          args.gradient_accumulation_steps * selection.num_train, selection_rng)


def update_policy(ctx, prepared, policy_update):
    """Upstream's update cadence around the policy_update seam: an optimizer step after every GA
    samples (and after a final partial block). The update's saved activations are metered
    (ctx.activation_meter). Returns (UpdateStats, grad norms)."""
    args = ctx.args
    num_samples = prepared.rollout.log_probs.shape[0]
    ctx.transformer.train()
    stats, grad_norms = UpdateStats(), []
    for block in range(0, num_samples, args.gradient_accumulation_steps):
        idx = torch.arange(block, min(block + args.gradient_accumulation_steps, num_samples), device=ctx.device)
        with ctx.activation_meter:
            block_stats = accumulate_policy_gradient(ctx, prepared.rollout, prepared.cond, prepared.advantages, idx,
                                                     prepared.selection.steps, prepared.normaliser, policy_update,
                                                     on_policy=not grad_norms)
        where = f" (optimizer step {len(grad_norms) + 1} of this step, samples {block}..{int(idx[-1])})"
        require_finite("loss", block_stats.loss, ctx.step, ctx.device, where)
        grad_norms.append(optimizer_step(ctx, where))
        stats += block_stats
    return stats, grad_norms


def optimizer_step(ctx, where):
    """Clip, check the norm, step, schedule; returns the grad norm before clipping. DeepSpeed's
    engine clips inside its step, so there the norm is checked after it (a non-finite one stops
    the run before any checkpoint is written: `save` checks the weights)."""
    if ctx.engine is not None:
        norm = ctx.engine.optimizer_step()
        require_finite("grad norm", norm, ctx.step, ctx.device, where)
    else:
        norm = clip_grad_norm(ctx.transformer, ctx.args.max_grad_norm)
        require_finite("grad norm", norm, ctx.step, ctx.device, where)
        ctx.optimizer.step()
        ctx.optimizer.zero_grad(set_to_none=True)
    ctx.lr_scheduler.step()
    return norm


def expand_groups(args, batch):
    """Repeat each prompt --num_generations times in contiguous blocks (with --use_group)."""
    captions = list(batch["caption"])
    cond = {k: v for k, v in batch.items() if k != "caption"}
    if args.use_group:
        cond = {k: v.repeat_interleave(args.num_generations, dim=0) for k, v in cond.items()}
        captions = [c for c in captions for _ in range(args.num_generations)]
    return cond, captions


def _sum_over_ranks(values, device):
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if is_distributed():
        torch.distributed.all_reduce(t)
    return [int(round(x)) for x in t.tolist()]


def train_one_step(ctx, policy_update, select_train_steps=vanilla_selection):
    """One GRPO step: rollout, reward, advantages, policy update. Returns the metrics record.

    `policy_update` and `select_train_steps` are the seams (dancegrpo.grpo), passed in by
    the trainer module so that a run-time patch of its attributes applies."""
    args = ctx.args
    t_start = time.time()
    ctx.optimizer.zero_grad(set_to_none=True)  # upstream's Qwen trainer leaked leftovers into the next step
    ctx.counter.reset()
    ctx.activation_meter.reset()
    cuda_peak_reset(ctx.device)
    prepared = prepare_update(ctx, select_train_steps, keep_outputs=wants_rollout_outputs(policy_update))
    t_rollout = time.time()

    stats, grad_norms = update_policy(ctx, prepared, policy_update)
    if ctx.ema is not None and ctx.step >= args.ema_start_step:
        ctx.ema.update()
    t_end = time.time()

    counts = ctx.counter.as_dict()
    summed = _sum_over_ranks([*counts.values(), stats.jagg_groups, stats.exact_groups, len(prepared.captions),
                              stats.forwards_reused], ctx.device)
    record = {
        "step": ctx.step,
        "reward_mean": prepared.all_rewards.mean().item(),
        "reward_std": prepared.all_rewards.std().item() if prepared.all_rewards.numel() > 1 else 0.0,
        "loss": all_reduce_mean(stats.loss, ctx.device),
        "grad_norm": sum(grad_norms) / len(grad_norms),
        "lr": ctx.lr_scheduler.get_last_lr()[0],
        "step_time_s": t_end - t_start,
        "rollout_time_s": t_rollout - t_start,
        "update_time_s": t_end - t_rollout,
        **dict(zip(counts, summed[:3])),
        "transformer_forwards_reused": summed[6],
        "jagg_groups": summed[3],
        "exact_groups": summed[4],
        "samples": summed[5],
        "train_timesteps": prepared.selection.num_train,
        "optimizer_steps": len(grad_norms),
        "world_size": ctx.world_size,
        # The largest rank's peak of tensors saved for backward during the update.
        "activation_peak_mb": all_reduce_max(ctx.activation_meter.peak_mb, ctx.device),
    }
    cuda_mb = cuda_peak_mb(ctx.device)
    if cuda_mb is not None:
        record["cuda_peak_mb"] = all_reduce_max(cuda_mb, ctx.device)
    for name, scores in getattr(ctx.reward_fn, "last_terms", {}).items():
        record[f"reward_{name}_mean"] = gather_tensor(scores.to(ctx.device)).mean().item()
    return record


def build_optimizer(args, model):
    from diffusers.optimization import get_scheduler
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate, betas=(0.9, 0.999),
                                  weight_decay=args.weight_decay, eps=1e-8)
    scheduler = get_scheduler(args.lr_scheduler, optimizer=optimizer, num_warmup_steps=args.lr_warmup_steps,
                              num_training_steps=1_000_000, num_cycles=args.lr_num_cycles, power=args.lr_power)
    return optimizer, scheduler


def prepare_transformer(args, family, transformer, device, world_size):
    """FSDP under torchrun, plain module otherwise; activation checkpointing if asked.
    A single process has nothing to reduce: bf16 there is the autocast of `autocast`."""
    blocks = family.block_classes(transformer)
    transformer.train()
    if world_size > 1:
        weight_type = resolve_weight_type(args.master_weight_type, family.gpu_fsdp_weight_type, device)
        model = wrap_fsdp(transformer, blocks, device, args.fsdp_sharding_startegy, args.use_cpu_offload,
                          weight_type)
    else:
        model = transformer.to(device)
    if args.gradient_checkpointing and args.selective_checkpointing > 0:
        apply_activation_checkpointing(model, blocks, args.selective_checkpointing)
    return model


def setup(args, family, plan=None):
    """Load models, data and reward; wrap for distributed; restore the planned checkpoint
    (`plan_run`'s; a tool without a run folder passes none)."""
    rank, world_size, _, device = init_distributed()
    plan = plan or tool_plan(args)
    if args.allow_tf32 and device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    seed, resume = plan["seed"], plan["resume"]
    torch.manual_seed(seed + rank)

    dataset = PromptEmbeddingDataset(args.data_json_path, family.embedding_fields)
    reward_fn = WeightedReward(args.reward_terms, device, args)
    raw, vae = family.load(args, device)
    frozen = frozen_copy(raw) if args.kl_beta > 0 and not args.use_lora else None   # before any wrapping
    weights_format = ckpt.FullWeights()
    if args.use_lora:
        add_lora(raw, args, seed)
        weights_format = LoraWeights(args, family.pipeline_class_name)
    if resume:
        weights_format.load_into(raw, resume)
    num_params = sum(p.numel() for p in raw.parameters())  # before FSDP shards them
    num_trainable = sum(p.numel() for p in raw.parameters() if p.requires_grad)
    engine = None
    if args.engine == "deepspeed":
        raw.to(device).train()
        if args.gradient_checkpointing and args.selective_checkpointing > 0:
            apply_activation_checkpointing(raw, family.block_classes(raw), args.selective_checkpointing)
        optimizer, scheduler = build_optimizer(args, raw)
        engine = DeepSpeedRun(raw, optimizer, args, device)
        model = engine.engine
    else:
        model = prepare_transformer(args, family, raw, device, world_size)
        optimizer, scheduler = build_optimizer(args, model)
    ema_model = raw if engine is not None else model   # the engine's names carry a module. prefix
    ema = ParamEMA(ema_model, args.ema_decay) if args.use_ema else None

    start_step = 0
    if resume:
        state = ckpt.load_training_state(resume, model, optimizer, scheduler, engine)
        start_step = state["step"] if state else 0
        if ema is not None and os.path.isdir(os.path.join(resume, "ema")):
            ema.load_full_state(ema_model, weights_format.read_state(os.path.join(resume, "ema")))

    sigmas = sigma_schedule(args.sampling_steps, args.shift)
    loader = infinite_prompt_batches(dataset, args.train_batch_size, rank, world_size,
                                     args.sampler_seed if args.sampler_seed is not None else seed,
                                     args.dataloader_num_workers, start_batch=start_step)
    ctx = TrainContext(args=args, family=family, transformer=model, raw_transformer=raw, vae=vae,
                       reward_fn=reward_fn, optimizer=optimizer, lr_scheduler=scheduler, loader=loader,
                       device=device, counter=PassCounter(raw), sigmas=sigmas, timesteps=model_timesteps(sigmas),
                       rank=rank, world_size=world_size, seed=seed, ema=ema, engine=engine, step=start_step)
    ctx.extra["resumed_from"] = resume
    ctx.extra["dataset"] = dataset
    ctx.extra["num_params"] = num_params
    ctx.extra["num_trainable"] = num_trainable
    ctx.extra["weights_format"] = weights_format
    if args.kl_beta > 0:
        def run(module, latents, timesteps, cond):
            with autocast(args, device):
                return family.predict(module, latents, timesteps, cond)
        ctx.extra["reference"] = (Reference(run, model, lora_raw=raw) if args.use_lora
                                  else Reference(run, frozen.to(device)))
    return ctx


def save(ctx, step):
    """A checkpoint of the weights after `step`'s update, after checking they are finite; then
    --checkpoints_total_limit retention."""
    finite = all(bool(torch.isfinite(p).all()) for p in ctx.transformer.parameters())
    require_finite("weights", torch.tensor(0.0 if finite else float("nan")), ctx.step, ctx.device,
                   " (checked before writing a checkpoint, which was not written)")
    weights_format = ctx.extra.get("weights_format", ckpt.FullWeights())
    ema_state = None
    if ctx.ema is not None:
        with ctx.ema.swapped_in():
            ema_state = (ctx.engine.full_state(weights_format.trainable_only) if ctx.engine is not None
                         else ckpt.full_model_state(ctx.transformer, weights_format.trainable_only))
    path = ckpt.save_checkpoint(ctx.args.output_dir, step, 0, ctx.transformer, ctx.raw_transformer.config,
                                ctx.optimizer, ctx.lr_scheduler, ctx.rank, ema_state=ema_state,
                                extra_state={"seed": ctx.seed}, run_config=snapshot(ctx.args, ctx.seed),
                                weights_format=weights_format, engine=ctx.engine)
    if ctx.rank == 0:
        ckpt.prune_checkpoints(ctx.args.output_dir, ctx.args.checkpoints_total_limit,
                               protect=(path, ctx.extra.get("resumed_from")))
    return path


def write_samples(ctx, step):
    """The sample grid of the weights after `step` (collective under FSDP; rank 0 decodes and writes)."""
    dataset = ctx.extra["dataset"]
    rows = samples.grid_rows([item["caption"] for item in dataset.items])
    cond = {k: v.to(ctx.device) for k, v in collate_prompts([dataset[i] for i in rows]).items() if k != "caption"}
    ctx.transformer.eval()
    latents = samples.sample_latents(ctx.family, lambda z, t, c: predict_velocity(ctx, z, t, c), ctx.sigmas,
                                     ctx.timesteps, cond)
    if ctx.rank == 0:
        return samples.save_grid(ctx.family.decode(ctx.vae, latents), ctx.args.output_dir, step)
    return None


def write_reward_curve(writer, output_dir, window=5):
    records = [r for r in writer.records() if "reward_mean" in r]
    if not records:
        return None
    rewards = [r["reward_mean"] for r in records]
    curve = {"steps": [r["step"] for r in records], "reward": rewards, "ma": moving_average(rewards, window)}
    return plot_reward_curves(os.path.join(output_dir, "reward_curve.png"), {f"reward (MA {window})": curve})


def describe(ctx):
    args = ctx.args
    n_params = ctx.extra["num_params"]
    samples = args.train_batch_size * (args.num_generations if args.use_group else 1)
    # Under --sde_window_size each sample trains its window, whatever the fraction.
    n_train = args.sde_window_size or num_train_timesteps(args.sampling_steps - 1, args.timestep_fraction)
    precision, weight_type = "", "fp32"
    if ctx.world_size > 1:
        weight_type = resolve_weight_type(args.master_weight_type, ctx.family.gpu_fsdp_weight_type, ctx.device)
        precision = f" (FSDP {weight_type})"
    if ctx.engine is not None:
        precision = f" (DeepSpeed ZeRO-{ctx.engine.stage})"
    lora = (f" | LoRA r{args.lora_rank} alpha {args.lora_alpha} on {args.lora_target_modules}: "
            f"{ctx.extra['num_trainable'] / 1e6:.3f}M trainable" if args.use_lora else "")
    return (f"{ctx.family.name}: {n_params / 1e6:.2f}M params | {ctx.world_size} rank(s){precision} on "
            f"{ctx.device}{lora} | "
            f"{samples} samples/rank/step, S={args.sampling_steps}, {n_train} trained transitions/sample, "
            f"GA={args.gradient_accumulation_steps} | seed {ctx.seed}"
            + (f" | resumed from {ctx.extra['resumed_from']} at step {ctx.step}" if ctx.extra.get("resumed_from") else "")
            + "\ntraining state: " + describe_bytes(per_rank_bytes(
                state_setup(ctx), n_params, ctx.extra["num_trainable"], ctx.world_size, weight_type)))


def state_setup(ctx):
    """The dancegrpo.state_memory setup of this run."""
    if ctx.engine is not None:
        return f"zero{ctx.engine.stage}"
    return "lora" if ctx.args.use_lora else "fsdp"


def _open_wandb(args, rank):
    if args.report_to != "wandb" or rank != 0:
        return None
    try:
        import wandb
    except ImportError:
        raise ImportError("--report_to wandb needs `pip install wandb` (or use --report_to none)") from None
    return wandb.init(project=f"dancegrpo-{args.family}", config=vars(args))


def run(args, family, train_one_step_fn):
    """The training loop. `train_one_step_fn(ctx) -> record` is the trainer module's
    own `train_one_step`, looked up at call time so a run-time patch applies.

    Before anything is loaded, rank 0 locks the output folder and checks the resume (plan_run);
    the lock is held until the run ends, however it ends."""
    rank = init_distributed()[0]
    run_id = uuid.uuid4().hex[:12]
    held = {}

    def decide():
        held["lock"], plan = plan_run(args, run_id)
        return plan

    plan = decide_on_rank0(decide, rank)
    stops = StopRequest().install(watch_parent="TORCHELASTIC_RUN_ID" in os.environ)
    try:
        return _train(args, family, train_one_step_fn, plan, run_id, stops)
    finally:
        stops.uninstall()
        if "lock" in held:
            held["lock"].release()


def _train(args, family, train_one_step_fn, plan, run_id, stops):
    from tqdm.auto import tqdm
    ctx = setup(args, family, plan)
    main = ctx.rank == 0
    writer = MetricsWriter(args.output_dir, enabled=main, wandb_run=_open_wandb(args, ctx.rank), run_id=run_id,
                           resume_step=ctx.step if plan["full_resume"] else None)
    if main:
        print(describe(ctx) + f" | run {run_id}", flush=True)
    bar = tqdm(total=args.max_train_steps, initial=ctx.step, desc="steps", disable=not main)
    last_saved = None
    if args.sample_every and ctx.step == 0:
        write_samples(ctx, 0)  # the "before" picture
    try:
        while ctx.step < args.max_train_steps:
            ctx.step += 1
            record = train_one_step_fn(ctx)
            writer.write(record)
            if args.sample_every and (ctx.step % args.sample_every == 0 or ctx.step == args.max_train_steps):
                write_samples(ctx, ctx.step)
            bar.update(1)
            bar.set_postfix(reward=f"{record['reward_mean']:.4f}", loss=f"{record['loss']:.3g}",
                            s=f"{record['step_time_s']:.2f}")
            # After the step's update, so checkpoint-N holds N updates (upstream saved before).
            if ctx.step % args.checkpointing_steps == 0 or ctx.step == args.max_train_steps:
                last_saved = save(ctx, ctx.step)
            signum = stops.pending(ctx.device)
            if signum:
                if last_saved != ckpt.checkpoint_dir(args.output_dir, ctx.step):
                    last_saved = save(ctx, ctx.step)
                raise Interrupted(f"{signal_name(signum)} after step {ctx.step}: saved {last_saved}; continue with "
                                  "--resume_from_checkpoint latest", signum)
    finally:
        bar.close()
    if main:
        write_reward_curve(writer, args.output_dir)
        print(f"done: {writer.summary()}" + (f" | checkpoint {last_saved}" if last_saved else ""), flush=True)
    shutdown()
    return writer.history
