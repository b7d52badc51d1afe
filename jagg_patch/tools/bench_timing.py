"""Timing for jagg_patch.tools.bench_update: a synchronised timer, the unit costs of one micro-batch
(forward with and without grad, backward, a joint backward of two graphs), the transitions each mode
trains, the update time predicted from the unit costs, and FSDP's collectives while a mode runs."""
import contextlib
import statistics
import time

import torch

from .comm_count import count_collectives
from .cost_model import sample_groups, seconds, sum_passes
from ..plan import Group
from ..update import make_window_selection


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    def __init__(self, device):
        self.device = device

    def __enter__(self):
        sync(self.device)
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        sync(self.device)
        self.seconds = time.perf_counter() - self.start


def gain(t, ref):
    return 1.0 - t / ref


class UnitCosts:
    """F_g, F_ng, B and B2 (one joint backward through two graphs) for one micro-batch, sampled in
    short rounds between the mode timings so that they see the same machine load."""

    def __init__(self, ctx, batch, k0, k1):
        self.ctx, self.batch, self.k0, self.k1 = ctx, batch, k0, k1
        self.samples = dict(f_grad=[], f_nograd=[], backward=[], joint_backward_2=[])

    def round(self, reps, record=True):
        ctx, batch = self.ctx, self.batch
        for _ in range(reps):
            with torch.no_grad(), Timer(ctx.device) as t_ng:
                batch.predict(self.k0)
            with Timer(ctx.device) as t_g:
                v = batch.predict(self.k0)
            with Timer(ctx.device) as t_b:
                torch.autograd.backward(v, torch.ones_like(v))
            v0, v1 = batch.predict(self.k0), batch.predict(self.k1)
            with Timer(ctx.device) as t_b2:
                torch.autograd.backward([v0, v1], [torch.ones_like(v0), torch.ones_like(v1)])
            del v, v0, v1
            ctx.transformer.zero_grad(set_to_none=True)
            if record:
                for key, t in (("f_nograd", t_ng), ("f_grad", t_g), ("backward", t_b), ("joint_backward_2", t_b2)):
                    self.samples[key].append(t.seconds)

    def medians(self):
        return {k: statistics.median(v) for k, v in self.samples.items()}


def selections_of(ctx, args, prepared):
    """{"vanilla": vanilla's TrainSelection, "jagg": the configured grouping's}: the same for the
    trained grouping (which keeps vanilla's subset) and under --sde_window_size (every mode trains
    the sampler's window); the window grouping draws from the generator state vanilla drew from."""
    from dancegrpo import trainer
    vanilla = prepared.selection
    if args.jagg_grouping == "trained" or prepared.rollout.window_start is not None:
        return {"vanilla": vanilla, "jagg": vanilla}
    generator = torch.Generator().set_state(prepared.selection_rng)
    return {"vanilla": vanilla, "jagg": trainer.train_selection(ctx, prepared.rollout, generator,
                                                                make_window_selection(args.jagg_window))}


def predicted_seconds(args, selection, num_transitions, mode, units, schedule="project"):
    """Update seconds of every sample's groups from the unit costs (per micro-batch of
    --update_batch_size samples, so per sample / update_batch_size) for a BenchMode (vanilla: every
    transition its own exact group). A reuse mode's on-policy samples (the first GA) take its reuse
    schedule (BenchMode.schedule); schedule "authors": the authors' pass schedule for every sample."""
    passes = [0, 0, 0]
    jagg_mode = mode.jagg_mode or "exact"
    for i_sample, row in enumerate(selection.steps.tolist()):
        if mode.vanilla:
            groups = [Group(0, (k,), False) for k in row if k >= 0]
        else:
            groups = sample_groups(row, num_transitions, args.jagg_window, args.jagg_frac, args.jagg_grouping)
        on_policy = i_sample < args.gradient_accumulation_steps
        sample_schedule = mode.schedule(on_policy) if schedule == "project" else schedule
        for i, n in enumerate(sum_passes(groups, jagg_mode, sample_schedule)):
            passes[i] += n
    return seconds(passes, units["f_grad"], units["f_nograd"], units["backward"]) / args.update_batch_size


@contextlib.contextmanager
def collectives(ctx):
    """FSDP1's or FSDP2's all-gathers and reduce-scatters per unit while the block runs (None without
    FSDP)."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel as FSDP
    if not isinstance(ctx.transformer, (FSDP, FSDPModule)):
        yield None
        return
    with count_collectives(ctx.transformer) as counts:
        yield counts


def collective_summary(counts, num_samples, micro_batch):
    """Per micro-batch of samples (one forward / backward of a unit gathers it once for all of them)."""
    per_unit = counts.per_unit()
    blocks = [n for name, n in per_unit.items() if name]
    calls = -(-num_samples // micro_batch)
    return dict(all_gathers=per_unit, reduce_scatters=counts.total_reduce_scatters(),
                all_gathers_per_block_unit_per_micro_batch=statistics.median(blocks) / calls if blocks else 0.0,
                root_all_gathers_per_micro_batch=per_unit.get("", 0) / calls,
                reduce_scatters_per_unit_per_micro_batch=counts.total_reduce_scatters() / len(per_unit) / calls,
                peak_gathered_units=counts.peak_gathered_units, units=len(per_unit),
                peak_gathered_mb=counts.peak_gathered_bytes / 2 ** 20)


def plan_replay_rows(steps, num_transitions, args):
    """The forwards with grad (each with its backward) the restated plan runs over every sample: two per
    JAGG group, one per member of an exact group (what a deferred flush's replay must match)."""
    rows = 0
    for row in steps.tolist():
        for g in sample_groups(row, num_transitions, args.jagg_window, args.jagg_frac, args.jagg_grouping):
            rows += 2 if g.jagg and g.size >= 2 else g.size
    return rows


def replay_counts(flushes):
    """A deferred mode's flushes in one update: the rows replayed with grad, those skipped for a zero
    signal, the backward calls they took, and the rows trained exactly by a reason other than routing."""
    return dict(rows=sum(s.forwards_grad for s in flushes), zero_rows=sum(s.zero_rows for s in flushes),
                backwards=sum(s.backward_calls for s in flushes),
                unplanned_exact_rows=sum(n for s in flushes for why, n in s.rows_exact.items() if why != "routed exact"))
