"""The DanceGRPO training loop shared by every model family: rollout -> rewards -> advantages
-> policy update -> optimizer step -> save.

Upstream's names are kept (`run_sample_step`, `sample_reference_model`, `grpo_one_step`,
`train_one_step`, importable from here) so that an upstream change can be ported by reading
both side by side. Setup is `dancegrpo.build`, the algorithm `dancegrpo.algo`, how the ranks
hold and step the model `dancegrpo.engines`. The per-sample policy update is the seam
`dancegrpo.algo.grpo.policy_update`, which the trainer modules pass in by name so that a
run-time patch applies; `prepare_update` is the one way the loop and every tool make a rollout
ready for it.
"""
import os
import sys
import time
import uuid
from dataclasses import dataclass

import torch

from .algo.advantages import compute_advantages
from .algo.grpo import (UpdateStats, policy_update as vanilla_policy_update, restore_update_state,
                        select_train_steps as vanilla_selection, update_state, wants_rollout_outputs,
                        window_train_steps)
from .algo.objective import accumulate_policy_gradient, grpo_one_step, make_update_batch  # noqa: F401 (re-exported)
from .algo.rollout import (Rollout, expand_groups, run_sample_step,  # noqa: F401 (upstream's names, re-exported)
                           sample_reference_model, step_generators)
from .build import describe, setup
from .outputs import save, write_reward_curve, write_samples, written
from .errors import Interrupted, PeerLost, RunHalted, say_stopped
from .run.finite import damaged_weights_hint, require_finite
from .run.preflight import preflight
from .run.resume import plan_run
from .run.signals import StopRequest, signal_name
from .utils import checkpoint as ckpt
from .utils.activation_meter import cuda_peak_mb, cuda_peak_reset
from .utils.communications import (all_reduce_max, all_reduce_mean, decide_on_rank0, gather_tensor, init_distributed,
                                   peer_lost, shutdown, sum_over_ranks)
from .utils.metrics import MetricsWriter, phase_times, reward_summary, update_counts


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
    damaged = lambda: damaged_weights_hint(ctx.transformer, ctx.device)  # noqa: E731 (asked only on NaN)
    require_finite("reward", all_rewards, ctx.step, ctx.device, hint=damaged)
    require_finite("rollout log-prob", rollout.log_probs, ctx.step, ctx.device, hint=damaged)
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
    """The engine's clip and step (the grad norm checked finite), then the schedule; returns the
    grad norm before clipping."""
    norm = ctx.engine.optimizer_step(lambda value: require_finite("grad norm", value, ctx.step, ctx.device, where))
    ctx.lr_scheduler.step()
    return norm


def train_one_step(ctx, policy_update, select_train_steps=vanilla_selection):
    """One GRPO step: rollout, reward, advantages, policy update. Returns the metrics record.

    `policy_update` and `select_train_steps` are the seams (dancegrpo.algo.grpo), passed in by
    the trainer module so that a run-time patch of its attributes applies."""
    args = ctx.args
    t_start = time.time()
    ctx.optimizer.zero_grad(set_to_none=True)  # upstream's Qwen trainer leaked leftovers into the next step
    ctx.counter.reset()
    ctx.activation_meter.reset()
    ctx.ratio_meter.reset()
    cuda_peak_reset(ctx.device)
    prepared = prepare_update(ctx, select_train_steps, keep_outputs=wants_rollout_outputs(policy_update))
    t_rollout = time.time()

    stats, grad_norms = update_policy(ctx, prepared, policy_update)
    if ctx.ema is not None and ctx.step >= args.ema_start_step:
        ctx.ema.update()
    t_end = time.time()

    summed = sum_over_ranks(update_counts(ctx.counter, stats, len(prepared.captions)), ctx.device)
    record = {
        "step": ctx.step,
        **reward_summary(prepared.all_rewards),
        "loss": all_reduce_mean(stats.loss, ctx.device),
        "grad_norm": sum(grad_norms) / len(grad_norms),
        "lr": ctx.lr_scheduler.get_last_lr()[0],
        **phase_times(t_start, t_rollout, t_end),
        **summed,
        "train_timesteps": prepared.selection.num_train,
        "optimizer_steps": len(grad_norms),
        "world_size": ctx.world_size,
        **ctx.record_labels,
        # The largest rank's peak of tensors saved for backward during the update.
        "activation_peak_mb": all_reduce_max(ctx.activation_meter.peak_mb, ctx.device),
        **ctx.ratio_meter.summary(ctx.device),   # ratio mean / min / max, clip_frac, approx_kl
        **stats.metrics,   # what a patched update measured beside the step (jagg_patch's monitor)
    }
    cuda_mb = cuda_peak_mb(ctx.device)
    if cuda_mb is not None:
        record["cuda_peak_mb"] = all_reduce_max(cuda_mb, ctx.device)
    for name, scores in getattr(ctx.reward_fn, "last_terms", {}).items():
        record[f"reward_{name}_mean"] = gather_tensor(scores.to(ctx.device)).mean().item()
    return record


def _open_wandb(args, rank):
    if args.report_to != "wandb" or rank != 0:
        return None
    try:
        import wandb
    except ImportError:
        raise ImportError("--report_to wandb needs `pip install wandb` (or use --report_to none)") from None
    return wandb.init(project=f"dancegrpo-{args.family}", config=vars(args))


def run(args, family, train_one_step_fn, current_update=lambda: vanilla_policy_update):
    """The training loop. `train_one_step_fn(ctx) -> record` is the trainer module's
    own `train_one_step`, looked up at call time so a run-time patch applies; `current_update()`
    its policy_update seam, whose state (grpo.update_state) each checkpoint saves and a resume restores.

    Before anything is loaded, rank 0 checks the model and data files (preflight), locks the output
    folder and checks the resume (plan_run); the lock is held until the run ends, however it ends."""
    rank, world_size = init_distributed()[:2]
    run_id = uuid.uuid4().hex[:12]
    held = {}

    def decide():
        preflight(args, family)
        held["lock"], plan = plan_run(args, run_id, world_size=world_size)
        return plan

    plan = decide_on_rank0(decide, rank)
    stops = StopRequest().install(watch_parent="TORCHELASTIC_RUN_ID" in os.environ)
    try:
        history = _train(args, family, train_one_step_fn, current_update, plan, run_id, stops)
    # A stop is said where it is decided, while SIGTERM is still this run's: once one rank has ended,
    # torchrun sends SIGTERM to the others, which would kill them silently after stops.uninstall().
    except RunHalted as halted:
        say_stopped(halted)
        raise
    except RuntimeError as error:
        said = peer_lost(error)
        if said is None:
            raise
        lost = PeerLost(f"rank {rank}: another rank's process ended while this one waited for it ({said}); this "
                        "rank stops too. The checkpoints written before are intact: continue with "
                        "--resume_from_checkpoint latest")
        say_stopped(lost)
        raise lost from None
    finally:
        stops.uninstall()
        if "lock" in held:
            held["lock"].release()
    # Every rank finished, and the run's objects are gone with _train's frame: the group is released
    # now (its threads joined), not at interpreter exit.
    shutdown()
    return history


def _train(args, family, train_one_step_fn, current_update, plan, run_id, stops):
    from tqdm.auto import tqdm
    ctx = setup(args, family, plan)
    main = ctx.rank == 0
    if plan["full_resume"]:
        restore_update_state(current_update(), ctx.resumed_update_state, log=print if main else lambda line: None)
    writer = MetricsWriter(args.output_dir, enabled=main, wandb_run=_open_wandb(args, ctx.rank), run_id=run_id,
                           resume_step=ctx.step if plan["full_resume"] else None)
    if main:
        print(describe(ctx) + f" | run {run_id}", flush=True)
    bar = tqdm(total=args.max_train_steps, initial=ctx.step, desc="steps", disable=not main)
    last_saved = None

    def checkpoint():   # of the weights after the current step, with what the policy update carries
        return save(ctx, ctx.step, update_state(current_update()))

    if args.sample_every and ctx.step == 0:
        written(ctx, "the sample grid before training", lambda: write_samples(ctx, 0))   # the "before" picture
    try:
        while ctx.step < args.max_train_steps:
            ctx.step += 1
            record = train_one_step_fn(ctx)
            # A full disk here keeps the step's training in a checkpoint, as one during a checkpoint does.
            written(ctx, f"step {ctx.step}'s metrics line", lambda: writer.write(record), checkpoint)
            if args.sample_every and (ctx.step % args.sample_every == 0 or ctx.step == args.max_train_steps):
                written(ctx, f"step {ctx.step}'s sample grid", lambda: write_samples(ctx, ctx.step), checkpoint)
            bar.update(1)
            bar.set_postfix(reward=f"{record['reward_mean']:.4f}", loss=f"{record['loss']:.3g}",
                            s=f"{record['step_time_s']:.2f}")
            # After the step's update, so checkpoint-N holds N updates (upstream saved before).
            if ctx.step % args.checkpointing_steps == 0 or ctx.step == args.max_train_steps:
                last_saved = checkpoint()
            signum = stops.pending(ctx.device)
            if signum:
                if last_saved != ckpt.checkpoint_dir(args.output_dir, ctx.step):
                    last_saved = checkpoint()
                raise Interrupted(f"{signal_name(signum)} after step {ctx.step}: saved {last_saved}; continue with "
                                  "--resume_from_checkpoint latest", signum)
    finally:
        bar.close()
    if main:
        write_reward_curve(writer, args.output_dir)
        print(f"done: {writer.summary()}" + (f" | checkpoint {last_saved}" if last_saved else ""), flush=True)
    ctx.engine.close()
    return writer.history


def trainer_entry(module_name):
    """The seams of a trainer module (see jagg_patch.seams): returns (policy_update,
    select_train_steps, train_one_step, main) for it to bind as its own attributes.

    `train_one_step` and `main` look the seams up in the module at call time, so a run-time
    patch of the module's attributes (jagg_patch) applies."""
    def train_one_step_of_module(ctx):
        module = sys.modules[module_name]
        return train_one_step(ctx, module.policy_update, module.select_train_steps)

    def main(args):
        module = sys.modules[module_name]
        return run(args, module.FAMILY(args), lambda ctx: module.train_one_step(ctx), lambda: module.policy_update)

    train_one_step_of_module.__name__ = "train_one_step"
    return vanilla_policy_update, vanilla_selection, train_one_step_of_module, main
