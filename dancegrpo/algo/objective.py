"""The GRPO objective of a rollout's transitions, handed to the policy-update seam as an
UpdateBatch (algo.grpo): the per-transition log-prob under the --sde_type kernel, the PPO clip
loss, Flow-GRPO's KL term, and upstream's `grpo_one_step`."""
import contextlib

import torch

from .grpo import UpdateBatch, UpdateStats, ppo_clip_loss
from .kernels import kernel, sde_transition
from .rollout import predict_velocity
from .sde import at_least_fp32


def transition_log_prob(ctx, v, latents, next_latents, index):
    """log p(next_latents | latents) under the policy whose output is v (the --sde_type kernel;
    dance: upstream's flux_step, grpo=True)."""
    return sde_transition(ctx.args.sde_type, v, latents, ctx.args.eta, ctx.sigmas, index,
                          prev_sample=at_least_fp32(next_latents))[1]


def kl_to_reference(ctx, v, latents, index, cond):
    """Flow-GRPO's KL term per sample: mean((mu_theta - mu_ref)^2) / (2 kl_scale^2), mu the
    kernel's mean under the policy (v, with grad) and under the reference (base weights, no grad)."""
    with torch.no_grad():
        v_ref = ctx.reference(latents, ctx.timesteps[index].to(latents.device), cond)
    mean, _, scale = kernel(ctx.args.sde_type, v, latents, ctx.args.eta, ctx.sigmas, index)
    mean_ref = kernel(ctx.args.sde_type, v_ref, latents, ctx.args.eta, ctx.sigmas, index)[0]
    per_element = (mean - mean_ref) ** 2 / (2 * scale ** 2)
    return per_element.mean(dim=tuple(range(1, per_element.ndim)))


def grpo_one_step(ctx, rollout, cond, sample_idx, index):
    """New log-prob of transition index[i] of sample sample_idx[i] (forward with grad)."""
    z = rollout.latents[sample_idx, index]
    v = predict_velocity(ctx, z, ctx.timesteps[index].to(z.device), cond)
    return transition_log_prob(ctx, v, z, rollout.latents[sample_idx, index + 1], index)


@contextlib.contextmanager
def measured_apart(counter, ratio_meter):
    """A measurement beside the update (JAGG's monitor): its transformer passes (counter, a PassCounter
    or None) and its ratios are kept out of the step's own counts and statistics."""
    with counter.apart() if counter is not None else contextlib.nullcontext(), ratio_meter.apart():
        yield


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
        old_log_prob = rollout.log_probs[sample_idx, k]
        ctx.ratio_meter.record(log_prob, old_log_prob, args.clip_range, sample_idx, k)
        per_sample = ppo_clip_loss(log_prob, old_log_prob, advantages[sample_idx], args.clip_range,
                                   args.adv_clip_max)
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
                       backward=ctx.engine.backward,
                       rollout_output=rollout_output if rollout.outputs is not None else None, on_policy=on_policy,
                       predict_batched=predict_batched, step=ctx.step,
                       parameters=lambda: [p for p in ctx.transformer.parameters() if p.requires_grad],
                       counted_apart=lambda: measured_apart(ctx.counter, ctx.ratio_meter),
                       gradient_probe=ctx.engine.gradient_probe)


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
