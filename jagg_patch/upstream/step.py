"""The restated train_one_step: upstream's own rollout (sample_reference_model), its own log-prob
(grpo_one_step, hence flux_step), and only upstream's inline parts written again with its rules:
the group repeat, the timesteps, the reward report, the advantages, the trained transitions drawn
on the global generator, the PPO-clip loss over GA * train_timesteps, the accumulation cadence, the
clip / optimizer / scheduler steps, the per-sample prints and barrier.

Each sample is one micro-batch, as upstream's; its gradient comes from jagg_patch's policy update
(make_policy_update) through an UpdateBatch whose closures call grpo_one_step: with the real
transformer behind a recording stand-in for a forward (predict), and with a stand-in that returns a
given output for the upstream gradient s_j (step_loss), so s_j flows through upstream's flux_step.
"""
import contextlib
import dataclasses
import inspect
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dancegrpo.algo.grpo import UpdateBatch, UpdateStats, wants_rollout_outputs
from dancegrpo.algo.objective import measured_apart
from dancegrpo.algo.ratio_stats import RatioMeter
from dancegrpo.utils.communications import all_reduce_mean, sum_over_ranks, world_size
from dancegrpo.utils.metrics import PassCounter, first_tensor, phase_times, update_counts

from ..seams import UPSTREAM_ROLLOUT_VALUES
from ..settings import resolve_backward
from .families import FAMILIES, repeat_captions, repeat_rows
from .fingerprint import UpstreamChanged, rollout_changed
from .rollout_record import RolloutRecorder, per_sample


def needs_group(family):
    return (f"upstream's {family} train_one_step needs --use_group (without it upstream fails with "
            "UnboundLocalError: its embeddings are bound only under --use_group)")


def call_by_name(fn, values):
    """fn(**{each of its parameters: values[name]}); a required parameter without a value fails, naming it."""
    params = inspect.signature(fn).parameters
    missing = [name for name, p in params.items() if name not in values and p.default is inspect.Parameter.empty]
    if missing:
        raise UpstreamChanged(f"upstream's {fn.__name__} takes {missing}, which jagg_patch.upstream has no value "
                              "for; see jagg_patch.seams.UPSTREAM_SEAMS")
    return fn(**{name: values[name] for name in params if name in values})


class RecordingTransformer:
    """What grpo_one_step gets as `transformer` for a forward: the real transformer, whose raw output
    it keeps (`output`) for the update."""

    def __init__(self, model):
        self.model, self.output = model, None

    def __call__(self, *args, **kwargs):
        result = self.model(*args, **kwargs)
        self.output = first_tensor(result)
        return result

    def __getattr__(self, name):   # train(), eval(), config, dtype ...: the real transformer's
        return getattr(self.model, name)


class FixedOutputTransformer(RecordingTransformer):
    """What grpo_one_step gets as `transformer` for a member's loss: it returns the given output (the
    detached proxy whose gradient is the member's upstream gradient s_j) instead of calling the model."""

    def __init__(self, model, output):
        super().__init__(model)
        self.output = output

    def __call__(self, *args, **kwargs):
        return (self.output,)


@dataclass
class LastTransition:
    """The latest transition's ratio and loss (and a family's loss terms), which upstream's per-sample
    print shows."""
    ratio: torch.Tensor = None
    loss: torch.Tensor = None
    terms: tuple = ()


@dataclass
class Trajectories:
    """One step's rollout as the update reads it; rows are samples, in upstream's order."""
    args: object
    prompts: dict            # per-sample prompt tensors (group-repeated), by upstream's names
    fixed: dict              # values every sample shares (SkyReels' empty prompt), by upstream's names
    extra: tuple             # the rollout's values besides rewards, latents, log-probs and sigmas (Flux:
                             # all_image_ids, Qwen-Image: all_txt_seq_lens, Qwen-Image-Edit: that and
                             # all_image_latents, SkyReels: first_frame_latents, Wan / HunyuanVideo: none)
    latents: torch.Tensor    # all_latents [B, S+1, ...]: packed tokens [L, C], or video latents
    log_probs: torch.Tensor  # all_log_probs [B, S]
    sigma_schedule: torch.Tensor
    timesteps: torch.Tensor  # [S] int(sigma * 1000), long
    rewards: dict            # {reward name: [B]} float32, the rank's own
    advantages: dict = None  # {reward name: [B]}
    normaliser: int = 0      # GA * train_timesteps
    outputs: torch.Tensor = None   # [B, S, rows, ...] the rollout's raw model outputs, when recorded

    def take(self, rows):
        """These samples' trajectories (rows: indices, repeats allowed), in that order: what a family
        that selects samples (HunyuanVideo's best-of-n) trains. The values every sample shares stay."""
        if self.extra:
            raise ValueError("jagg_patch.upstream: a selection of samples over per-sample rollout values is not "
                             "written for this family")
        pick = (lambda v: v[rows] if torch.is_tensor(v) else [v[int(r)] for r in rows])
        return dataclasses.replace(
            self, prompts={k: pick(v) for k, v in self.prompts.items()}, latents=self.latents[rows],
            log_probs=self.log_probs[rows], rewards={k: v[rows] for k, v in self.rewards.items()},
            advantages={k: v[rows] for k, v in (self.advantages or {}).items()},
            outputs=None if self.outputs is None else self.outputs[rows.to(self.outputs.device)])


def _rank():
    return dist.get_rank() if dist.is_initialized() else 0


def report_rewards(gathered, trainer):
    """Rank 0 prints every rank's rewards and appends their mean to the release's reward files, in
    the family's reward order (./reward.txt; ./hps_reward.txt before bbf5278; HunyuanVideo's
    ./vq_reward.txt, ./mq_reward.txt), as upstream. (A count of files other than the family's rewards
    is an upstream change, stopped at apply; under --jagg_allow_upstream_changes the files that pair
    with a reward are written.)"""
    if _rank() != 0:
        return
    for rewards, label, path in zip(gathered.values(), trainer.gathered_labels, trainer.reward_files):
        print(label, rewards, flush=True)
        with open(path, "a") as f:
            f.write(f"{rewards.mean().item()}\n")   # the float's full repr, as upstream


def optimizer_step(family, transformer, optimizer, lr_scheduler, max_grad_norm):
    """The family's clip, optimizer and scheduler step, zero grad."""
    grad_norm = family.clip(transformer, max_grad_norm)
    optimizer.step()
    lr_scheduler.step()
    optimizer.zero_grad()
    return grad_norm


def sample_batch(module, family, traj, i, steps, on_policy, transformer, last, ratios, step=0, counter=None):
    """The UpdateBatch of sample i (a micro-batch of one). `last` (a LastTransition) keeps the latest
    ratio and loss; `ratios` (a RatioMeter) the step's ratio statistics; `step` (the training step)
    and `counter` (the step's PassCounter) serve the monitor."""
    args = traj.args

    def grpo_one_step(ks, model):
        """upstream's grpo_one_step on sample i's transitions ks (each a LongTensor [1]), stacked."""
        values = {"args": args, "transformer": model, "sigma_schedule": traj.sigma_schedule, "i": ks[0][0],
                  "latents": torch.cat([traj.latents[i, k] for k in ks]),
                  "pre_latents": torch.cat([traj.latents[i, k + 1] for k in ks]),
                  "timesteps": torch.cat([traj.timesteps[k] for k in ks]),
                  **family.condition(traj, i, len(ks))}
        return call_by_name(module.grpo_one_step, values)

    def predict(k):
        model = RecordingTransformer(transformer)
        grpo_one_step([k], model)
        return model.output

    def predict_batched(ks):
        model = RecordingTransformer(transformer)
        grpo_one_step(list(ks), model)   # one transformer call; its log-prob (one index for all) is unused
        return per_sample(model.output, len(ks))   # a guided call's blocks: each member's rows

    def step_loss(k, v):
        log_prob = grpo_one_step([k], FixedOutputTransformer(transformer, v))
        old = traj.log_probs[i, k]
        ratios.record(log_prob, old, family.clip_range(args), torch.tensor([i]), k)
        advantages = {name: a[i:i + 1] for name, a in traj.advantages.items()}
        loss, terms = family.sample_loss(log_prob, old, advantages, traj.normaliser, args)
        last.ratio, last.loss, last.terms = torch.exp(log_prob - old).detach(), loss.detach(), terms
        return loss

    def rollout_output(k):
        return traj.outputs[i, k].flatten(0, 1)   # [1, rows, ...] -> the raw output of a call on sample i

    return UpdateBatch(predict=predict, step_loss=step_loss, steps=steps,
                       timesteps=family.alpha_timesteps(traj.timesteps),
                       subset=lambda rows: sample_batch(module, family, traj, i, steps[rows], on_policy,
                                                        transformer, last, ratios, step, counter),
                       rollout_output=rollout_output if traj.outputs is not None else None, on_policy=on_policy,
                       predict_batched=predict_batched, step=step,
                       parameters=lambda: [p for p in transformer.parameters() if p.requires_grad],
                       counted_apart=lambda: measured_apart(counter, ratios))


def rollout(module, family_name, update, named, rows=1):
    """Upstream's group repeat and its own sample_reference_model (with the transformer's outputs
    recorded when the update reuses them; `rows`: a call's rows per sample) -> Trajectories without
    advantages."""
    family = FAMILIES[family_name]
    args = named["args"]
    prompts, caption = family.prompts(named)
    if args.use_group:
        prompts = {name: repeat_rows(value, args.num_generations) for name, value in prompts.items()}
        caption = repeat_captions(caption, args.num_generations)
    elif family.needs_group:
        raise ValueError(needs_group(family_name))
    family.check(prompts)
    check_before_rollout(family, args, update, num_rows(prompts))
    fixed = family.fixed_values(named)
    recorder = RolloutRecorder(named["transformer"], rows) if wants_rollout_outputs(update) else None
    with recorder or contextlib.nullcontext():
        result = call_by_name(module.sample_reference_model,
                              {**named, **family.rollout_values(prompts, fixed), "caption": caption})
    if len(result) != UPSTREAM_ROLLOUT_VALUES[family_name]:
        raise UpstreamChanged(rollout_changed(family_name, len(result)))
    values = family.unpack(result)
    timestep_value = [int(sigma * 1000) for sigma in values.sigma_schedule][:args.sampling_steps]
    return Trajectories(
        args=args, prompts=prompts, fixed=fixed, extra=values.extra, latents=values.latents,
        log_probs=values.log_probs, sigma_schedule=values.sigma_schedule,
        timesteps=torch.tensor(timestep_value, device=values.latents.device, dtype=torch.long),
        rewards={name: r.to(torch.float32) for name, r in values.rewards.items()},
        outputs=recorder.outputs(values.latents) if recorder is not None else None)


def num_rows(prompts):
    """The samples the rollout draws: the prompt tensors' rows (after the group repeat)."""
    return next(len(v) for v in prompts.values())


def check_before_rollout(family, args, update, rows):
    """The family's refusals and the accumulation's, before any transformer call: a step that would
    never step the optimizer is refused (upstream fails after its rollout on an unbound grad_norm)."""
    family.check_run(args, resolve_backward(update.jagg_config.backward), rows)
    trained = family.trained_samples(args, rows)
    if args.gradient_accumulation_steps > trained:
        raise ValueError(f"jagg_patch.upstream: --gradient_accumulation_steps {args.gradient_accumulation_steps} "
                         f"exceeds the {trained} samples a rank trains per step, so the step would never step the "
                         "optimizer (upstream then fails on an unbound grad_norm); lower it")


@dataclass
class Accumulated:
    """What the accumulation loop of one step leaves: the update's counts, the loss summed as upstream
    sums it, the last optimizer step's grad norm, the number of optimizer steps."""
    stats: UpdateStats
    total_loss: float
    grad_norm: torch.Tensor
    optimizer_steps: int


def advantages_and_selection(module, family, trainer, traj, args):
    """Every rank's rewards gathered and reported (rank 0's reward files), the family's advantages,
    then its selection of the samples to train (HunyuanVideo's best-of-n, its shuffle drawn always).
    Returns (the trajectories trained, the gathered rewards)."""
    gathered = {name: module.gather_tensor(r) for name, r in traj.rewards.items()}
    report_rewards(gathered, trainer)
    traj.advantages = family.advantages(traj.rewards, gathered, args)
    return family.select(traj, args), gathered


def accumulate(module, trainer, update, traj, steps, named, step, counter, ratios):
    """Upstream's accumulation loop: each sample a micro-batch whose gradient the update computes, an
    optimizer step after every GA samples (the family's clip), the per-sample print and barrier."""
    family = FAMILIES[trainer.family]
    args, transformer, device = named["args"], named["transformer"], named["device"]
    ga = args.gradient_accumulation_steps
    stats, total_loss, grad_norm, optimizer_steps, last = UpdateStats(), 0.0, None, 0, LastTransition()
    for i in range(traj.latents.shape[0]):
        sample_stats = update(sample_batch(module, family, traj, i, steps[i:i + 1], optimizer_steps == 0,
                                           transformer, last, ratios, step, counter))
        stats += sample_stats
        loss = all_reduce_mean(sample_stats.loss, device)
        if not math.isfinite(loss):
            raise FloatingPointError(f"jagg_patch.upstream: the loss of sample {i} is {loss}; stopped before the "
                                     "optimizer step, so the weights are not trained on it")
        total_loss += loss
        if (i + 1) % ga == 0:
            grad_norm = optimizer_step(family, transformer, named["optimizer"], named["lr_scheduler"],
                                       named["max_grad_norm"])
            optimizer_steps += 1
        if _rank() % 8 == 0:
            family.print_sample(traj, i, last, trainer.reward_label)
        if dist.is_initialized():
            dist.barrier()
    if grad_norm is None:
        raise RuntimeError(f"jagg_patch.upstream: no optimizer step in this step: --gradient_accumulation_steps "
                           f"{ga} exceeds the {traj.latents.shape[0]} samples a rank trains; lower it")
    return Accumulated(stats, total_loss, grad_norm, optimizer_steps)


def train_step(module, trainer, update, select_train_steps, named, step=1):
    """One upstream training step (the run's `step`-th) of the checked trainer file (`trainer`, a
    fingerprint.Trainer) with the policy update `update`, in upstream's order: rollout, advantages,
    the accumulation loop. Returns ((total_loss, grad_norm), stats) with stats counted by hooks on the
    transformer, the gathered rewards, and what the update measured beside it (the monitor's metrics,
    the routing)."""
    family = FAMILIES[trainer.family]
    args, transformer, device = named["args"], named["transformer"], named["device"]
    rows = family.call_rows(args)
    counter, ratios, t_start = PassCounter(transformer, rows), RatioMeter(), time.time()
    try:
        if family.zero_grad_first:
            named["optimizer"].zero_grad()
        traj = rollout(module, trainer.family, update, named, rows)
        traj, gathered = advantages_and_selection(module, family, trainer, traj, args)
        # Upstream's draw (a randperm per sample on the global generator), or the window grouping's.
        selection = select_train_steps(traj.latents.shape[0], traj.log_probs.shape[1] - 1, args.timestep_fraction,
                                       None)
        traj.normaliser = args.gradient_accumulation_steps * selection.num_train
        t_update = time.time()
        done = accumulate(module, trainer, update, traj, selection.steps.to(device), named, step, counter, ratios)
        t_end = time.time()
    finally:
        counter.remove()
    num_samples = traj.latents.shape[0]
    # The trainer's record names (dancegrpo.utils.metrics), its counts summed over the ranks, as the trainer's.
    counts = sum_over_ranks({**update_counts(counter, done.stats, num_samples),
                             "backward_calls": done.stats.backward_calls}, device)
    stats_dict = {**counts, "world_size": world_size(),
                  "optimizer_steps": done.optimizer_steps, "loss": done.total_loss,
                  "grad_norm": done.grad_norm.item(), **family.reward_record(gathered, args),
                  **phase_times(t_start, t_update, t_end), **ratios.summary(device), **done.stats.metrics}
    return (done.total_loss, done.grad_norm.item()), stats_dict
