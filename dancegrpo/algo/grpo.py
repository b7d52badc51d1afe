"""GRPO pieces shared by every model family: the PPO loss, the trained-transition selection,
and the two seams of the policy update (advantages: algo.advantages).

`policy_update` (how a micro-batch's gradient is computed) and
`select_train_steps` (which transitions each sample trains) are what the JAGG
patch replaces (see `jagg_patch.seams`). They receive closures and sizes, not a
model, so they are the same for Flux and Qwen-Image and know nothing about FSDP,
prompts or rewards.
"""
from dataclasses import dataclass, field
from typing import Callable

import torch
from ..errors import ConfigError


def ppo_clip_loss(log_prob, old_log_prob, advantages, clip_range, adv_clip_max):
    """Per-sample PPO-clip objective max(-A r, -A clip(r, 1-eps, 1+eps)), A clamped."""
    adv = advantages.clamp(-adv_clip_max, adv_clip_max)
    ratio = torch.exp(log_prob - old_log_prob)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_range, 1.0 + clip_range)
    return torch.maximum(unclipped, clipped)


def num_train_timesteps(num_transitions, timestep_fraction):
    """int((S-1) * fraction) trained transitions per sample, at least one."""
    if not 0.0 < timestep_fraction <= 1.0:
        raise ConfigError(f"--timestep_fraction must be in (0, 1], got {timestep_fraction}")
    n = int(num_transitions * timestep_fraction)
    if n < 1:
        raise ConfigError(f"--timestep_fraction {timestep_fraction} trains no transition out of "
                         f"{num_transitions}; raise it or --sampling_steps")
    return n


def choose_train_steps(num_samples, num_transitions, num_train, generator=None):
    """Per sample, a random permutation of the transitions, truncated to `num_train`.

    Returns a LongTensor [num_samples, num_train] in the (random) order vanilla
    trains them, exactly as upstream's per-sample randperm.
    """
    perms = [torch.randperm(num_transitions, generator=generator)[:num_train] for _ in range(num_samples)]
    return torch.stack(perms)


@dataclass
class TrainSelection:
    """Which transitions each sample trains, and the loss normaliser that goes with it.

    steps: LongTensor [N, n], the trained transitions of each sample, in the order vanilla
        trains them; -1 pads a sample that trains fewer than n (only selections whose count
        varies per sample produce it; upstream's never does).
    num_train: each transition's loss is divided by GA * num_train (upstream's train_timesteps).
    """
    steps: torch.Tensor
    num_train: int


def window_train_steps(window_start, window_size):
    """Flow-GRPO-Fast: each sample trains exactly its SDE window's transitions, in order."""
    steps = window_start.reshape(-1, 1) + torch.arange(window_size).reshape(1, -1)
    return TrainSelection(steps, window_size)


def select_train_steps(num_samples, num_transitions, timestep_fraction, generator=None):
    """Seam: upstream's choice, int(num_transitions * fraction) random transitions per sample."""
    num_train = num_train_timesteps(num_transitions, timestep_fraction)
    return TrainSelection(choose_train_steps(num_samples, num_transitions, num_train, generator), num_train)


@dataclass
class UpdateBatch:
    """One micro-batch of m samples as the policy update sees it.

    predict(k) -> v: model output for transition k[i] of sample i (k: LongTensor [m]);
        it runs the transformer with grad if grad is enabled.
    step_loss(k, v) -> scalar: the summed, normalised PPO loss of the m samples at
        transitions k given output v; it runs no transformer pass.
    steps: LongTensor [m, n], the trained transitions (TrainSelection.steps of these samples).
    timesteps: float tensor [S], model timestep of each transition k = 0..S-1 (the last
        transition is never trained, so S-1 transitions are trainable).
    subset(rows) -> UpdateBatch of the samples at positions `rows` (LongTensor) of this one.
    backward(outputs, grads=None): torch.autograd.backward's contract, for an engine that must run
        every backward itself (DeepSpeed); None: torch.autograd.backward.
    rollout_output(k) -> the output the rollout's own forward gave for transition k[i] of sample i
        (no graph); None when the rollout did not keep its outputs (see `wants_rollout_outputs`).
    on_policy: no optimizer step has run since the rollout, so the parameters are the ones that
        produced rollout_output (predict(k) without grad would recompute it).
    predict_batched(ks) -> [v for k in ks]: predict for several transition vectors in ONE
        transformer call (the samples stacked len(ks) times); the same outputs as separate calls.
    step: the training step this micro-batch belongs to (1, 2, ...).
    parameters() -> the trainable parameters whose .grad the backward accumulates into (this rank's
        shards under FSDP), for an update that measures gradients beside the step's own.
    counted_apart() -> a context manager: the transformer passes inside it are counted as a
        measurement's (monitor_forwards / monitor_backwards), not as the update's.
    gradient_probe() -> a probe (dancegrpo.engines.probe) that takes a measurement's gradients
        beside the step's own; None: one over parameters() that reads .grad (needs backward None).
    """
    predict: Callable
    step_loss: Callable
    steps: torch.Tensor
    timesteps: torch.Tensor
    subset: Callable = None
    backward: Callable = None
    rollout_output: Callable = None
    on_policy: bool = False
    predict_batched: Callable = None
    step: int = 0
    parameters: Callable = None
    counted_apart: Callable = None
    gradient_probe: Callable = None


@dataclass
class UpdateStats:
    loss: float = 0.0
    backward_calls: int = 0
    jagg_groups: int = 0
    exact_groups: int = 0
    forwards_reused: int = 0   # per sample: model outputs taken from the rollout instead of a forward
    metrics: dict = field(default_factory=dict)   # more values for the step's record (the same on every rank)

    def __iadd__(self, other):
        self.loss += other.loss
        self.backward_calls += other.backward_calls
        self.jagg_groups += other.jagg_groups
        self.exact_groups += other.exact_groups
        self.forwards_reused += other.forwards_reused
        self.metrics.update(other.metrics)
        return self


def policy_update(batch: UpdateBatch) -> UpdateStats:
    """Vanilla DanceGRPO: one forward with grad and one backward per trained transition."""
    stats = UpdateStats()
    for j in range(batch.steps.shape[1]):
        k = batch.steps[:, j]
        loss = batch.step_loss(k, batch.predict(k))
        (batch.backward or torch.autograd.backward)([loss])
        stats.loss += loss.item()
        stats.backward_calls += 1
    return stats


# Vanilla needs a forward with grad at every trained transition: the rollout's outputs are of no use.
policy_update.uses_rollout_outputs = False


def update_state(update):
    """What a policy_update seam keeps across training steps (its `state_dict()`; vanilla keeps
    nothing: None). Saved with every checkpoint, so that a resumed run updates as the unbroken one."""
    state_dict = getattr(update, "state_dict", None)
    return state_dict() if callable(state_dict) else None


def restore_update_state(update, state, log=print):
    """Give a resumed run's policy_update the state its checkpoint saved (None: the checkpoint saved
    none). Either side without the other is said in one line: the update then starts afresh."""
    load = getattr(update, "load_state_dict", None)
    if state is not None and callable(load):
        load(state)
    elif state is not None:
        log("notice: the checkpoint holds the state of a patched policy update (e.g. JAGG's --jagg_frac auto "
            "routing) that this run's update does not keep; it is not used")
    elif callable(load):
        log("notice: the checkpoint holds no state of this run's policy update (written by a run without it): "
            "it starts afresh (JAGG's --jagg_frac auto: every position exact until the next measurement)")


def wants_rollout_outputs(update):
    """Whether a policy_update seam asks the rollout to keep its model outputs (memory: one tensor
    the size of the stored latents) and reads UpdateBatch.rollout_output."""
    return bool(getattr(update, "uses_rollout_outputs", False))
