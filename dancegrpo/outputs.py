"""What a run writes besides its metrics: checkpoints of the weights after a step (with
--checkpoints_total_limit retention), sample grids, and the reward curve; and what a full disk
under any of the run's writes does (`written`)."""
import os

import torch

from .algo.rollout import predict_velocity
from .errors import DiskFullError, is_disk_full
from .run.finite import require_finite
from .run.readers import exclusive
from .run.run_config import CONFIG_NAME, snapshot
from . import samples
from .utils import checkpoint as ckpt
from .utils.communications import all_reduce_max
from .utils.data import collate_prompts
from .utils.plots import moving_average, plot_reward_curves


def save(ctx, step, update_state=None):
    """A checkpoint of the weights after `step`'s update, after checking they are finite, with
    --checkpoints_total_limit retention before and after it; `update_state`: what the policy update
    keeps across steps (grpo.update_state), saved beside the step and seed."""
    finite = all(bool(torch.isfinite(p).all()) for p in ctx.transformer.parameters())
    require_finite("weights", torch.tensor(0.0 if finite else float("nan")), ctx.step, ctx.device,
                   " (checked before writing a checkpoint, which was not written)")
    weights_format = ctx.adapter.weights_format
    ema_state = None
    if ctx.ema is not None:
        with ctx.ema.swapped_in():
            ema_state = ctx.engine.full_state(weights_format.trainable_only)
    out, limit = ctx.args.output_dir, ctx.args.checkpoints_total_limit
    # The checkpoint resumed from is spared until this run has written a whole one of its own; from
    # then on the limit counts it like any other, so a disk that holds two keeps a limit of 1 running.
    resumed = None if ctx.saved_since_resume else ctx.resumed_from
    if ctx.rank == 0 and limit:   # retention before the write: the disk never needs room for the limit + 1
        _retain(out, lambda: ckpt.make_room(out, limit, ckpt.checkpoint_dir(out, step), protect=(resumed,)))
    path = ckpt.save_checkpoint(out, step, 0, ctx.engine, ctx.raw_transformer.config, ctx.rank,
                                ema_state=ema_state, extra_state={"seed": ctx.seed, "policy_update": update_state},
                                json_files={CONFIG_NAME: snapshot(ctx.args, ctx.seed, ctx.world_size)},
                                weights_format=weights_format)
    ctx.saved_since_resume = True
    if ctx.rank == 0 and limit:
        _retain(out, lambda: ckpt.prune_checkpoints(out, limit, protect=(path,)))
    return path


def written(ctx, what, write, checkpoint=None):
    """Run `write` (the metrics line, a sample grid: on rank 0, or collective) and agree over the ranks
    whether it found the disk full. If so, every rank keeps the training done so far as the checkpoint
    path does (`checkpoint()`: this step's, when there is room for it; None: nothing trained yet) and
    stops with DiskFullError (exit 3), naming what was not written; what was written before stays."""
    error = None
    try:
        write()
    except OSError as e:
        if not is_disk_full(e):
            raise
        error = e
    if not all_reduce_max(float(error is not None), ctx.device):
        return
    out = ctx.args.output_dir
    why = getattr(error, "strerror", None) or "No space left on device"
    try:
        kept = "no step was trained yet" if checkpoint is None else f"the training so far is kept in {checkpoint()!r}"
    except DiskFullError:
        kept = f"no checkpoint of this step could be written either; {ckpt.previous_kept(out)}"
    raise DiskFullError(f"no space left to write {what} in {out!r} ({why}); {kept}. "
                        f"{ckpt.FULL_DISK_ADVICE}") from None


def _retain(output_dir, prune):
    """Run `prune` unless a reader (dancegrpo.evaluate) holds the folder: then the old checkpoints stay
    until a later save finds it free."""
    with exclusive(output_dir) as readers:
        if readers:
            print(f"notice: --checkpoints_total_limit: old checkpoints in {output_dir!r} kept for now, "
                  f"{'; '.join(readers)} reads them", flush=True)
            return
        prune()


def write_samples(ctx, step):
    """The sample grid of the weights after `step` (collective under FSDP; rank 0 decodes and writes)."""
    dataset = ctx.dataset
    cond = {k: v.to(ctx.device) for k, v in collate_prompts([dataset[i] for i in ctx.sample_rows]).items()
            if k != "caption"}
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
