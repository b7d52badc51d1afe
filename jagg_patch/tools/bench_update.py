"""Update-phase micro-benchmark: vanilla vs the JAGG variants on ONE rollout, in ONE process.

    python -m jagg_patch.tools.bench_update dancegrpo.train_grpo_flux --preset small --output_dir runs/bench \\
        [--jagg_window 4] [--jagg_frac 0.6] [--jagg_grouping trained|window] [--jagg_alpha timestep|index] \\
        [--bench_reps 3] [--bench_unit_reps 5] [--bench_modes vanilla,jagg,jagg_split,exact,endpoints] \\
        [--bench_rollout_reps 2] [--bench_json F] [--bench_md F]
    torchrun --nproc_per_node=2 -m jagg_patch.tools.bench_update ...   # FSDP: also counts the collectives

Modes: vanilla (dancegrpo's own seams), jagg (joint backward), jagg_split (split backward),
jagg_batched (both endpoints in one forward), each also with _reuse (--jagg_reuse_rollout
on_policy: the first GA samples take their middle members' outputs from the rollout), exact
(per-step backward of the same groups) and endpoints (the ablation, joint backward); deferred,
deferred_batched (replay chunks of twice the call rows) and their _reuse run vanilla's own update with
the transformer behind jagg_patch.deferred's proxy (its rollout recorded by re-running the same rollout
through it, untimed; the flush is timed with the update; with _reuse the first GA samples' calls take
the rollout's outputs), not among the defaults: --bench_modes vanilla,jagg_batched_reuse,deferred_batched_reuse. A JAGG mode
with _auto (jagg_auto, jagg_split_reuse_auto, ...) is --jagg_frac auto with the live fidelity
monitor measuring in every timed run (each run is a new training step to it, so the monitor's
passes are in every timing): its time splits into the monitor's (monitor_time_s) and the routed
update's, and its step ratio at the run's cadence, one measurement every --jagg_monitor_every steps
(10 when not given, as auto's default), is the routed update plus 1/N of the measurement. The JAGG
modes share --jagg_window / --jagg_frac / --jagg_alpha / --jagg_grouping; with the window grouping
they train the windows that grouping draws (vanilla keeps its own random subset). The checks are
made on the mode the configured --jagg_backward / --jagg_reuse_rollout run (the headline).
Under FSDP, the untimed pass also counts the all-gathers and reduce-scatters per unit
(jagg_patch.tools.comm_count; FSDP1's or FSDP2's) and the most parameter bytes gathered at once.

Steps:
1. trainer.setup + sample_reference_model: one rollout. The same rollout is re-run and timed
   --bench_rollout_reps times after every repetition of step 2; the median is the rollout time of
   a training step with these samples (sampling, decode and reward).
2. The update phase (trainer.accumulate_policy_gradient over every rollout sample, gradients only,
   the optimizer step is the same for all modes and left out) of each mode, interleaved (the mode
   order rotates every repetition), --bench_reps times; medians. Then, untimed, each mode once
   more under dancegrpo.utils.activation_meter.ActivationMeter: the peak of the tensors saved for backward.
3. Unit costs on the same model and micro-batch (--update_batch_size samples, one transition),
   --bench_unit_reps times after every repetition of step 2 (same machine load): F_g forward with
   grad, F_ng forward under no_grad, B backward of one forward's graph, and B2 one joint backward
   through two forwards' graphs (what a joint JAGG group does; ~2 B).

Printed: the medians, the measured update-phase speedup of each mode vs vanilla, the speedup
predicted from the unit costs and the pass counts of the groups each sample ran (see
jagg_patch.tools.cost_model: JAGG 2 F_g + (w-2) F_ng + 2 B per group, exact w (F_g + B)), what the
authors' pass schedule (w F_ng + 2 F_g + 2 B per JAGG group) would cost with the same unit
costs, and the whole-step speedup (rollout + update_vanilla) vs (rollout + update_jagg).
Speedup = 1 - t_mode / t_vanilla (the paper's "gain", e.g. 279 s -> 228 s is 18.3%); the time
ratio is given too. Checks are printed, not asserted: the measured update speedup against 95% of
the predicted one, the activation peak against 1.05 x vanilla's, and the targets the caller gives
(--bench_target_step, --bench_target_update, --bench_paper_step_gain: the benchmark scripts pass
theirs; the tool holds none).

The modes are a table of named records (jagg_patch.tools.bench_modes), the timing and the prediction
live in jagg_patch.tools.bench_timing, the report in jagg_patch.tools.bench_report.
"""

import statistics
import sys

if __name__ == "__main__":   # --help and flag errors, before torch loads
    from jagg_patch.tools.tool_args import add_bench_args as _flags, answer_first
    answer_first("jagg_patch.tools.bench_update", __doc__, _flags)

import torch  # noqa: E402

from dancegrpo.utils.launch import launch_rank  # noqa: E402
from dancegrpo.utils.precision import describe_precision  # noqa: E402

from ..cli import check_trajectory, trainer_cli  # noqa: E402
from ..config import AUTO_MONITOR_EVERY  # noqa: E402
from .bench_modes import headline_mode, make_update, parse_modes  # noqa: E402
from .bench_report import auto_summary, checks, fixed_summary, format_report  # noqa: E402
from .bench_timing import (Timer, UnitCosts, collective_summary, collectives, plan_replay_rows,  # noqa: E402
                           predicted_seconds, replay_counts, selections_of)
from .cost_model import sample_groups  # noqa: E402
from .reports import print_and_write  # noqa: E402
from .tool_args import add_bench_args  # noqa: E402


class Bench:
    """One rollout and what every mode needs to run its update on it, interleaved: the modes, their
    updates, the trained transitions, the unit costs; and the times they measured."""

    def __init__(self, module, args, modes):
        from dancegrpo import trainer
        from dancegrpo.algo.grpo import policy_update as vanilla_update
        self.trainer, self.args, self.modes = trainer, args, modes
        self.ctx = ctx = trainer.setup(args, module.FAMILY(args))
        self.prepared = trainer.prepare_update(ctx, keep_outputs=True, step=1)   # the rollout is also the warm-up
        self.rollout = self.prepared.rollout
        self.num_samples = self.rollout.log_probs.shape[0]
        self.num_transitions = self.rollout.log_probs.shape[1] - 1
        self.selections = selections_of(ctx, args, self.prepared)
        self.all_idx = torch.arange(self.num_samples, device=ctx.device)
        self.proxies = {m.name: self._recorded_proxy(m) for m in modes if m.deferred}
        ctx.transformer.train()
        self.updates = {m.name: vanilla_update if m.vanilla else make_update(args, m) for m in modes}
        vanilla_steps = self.selections["vanilla"].steps.to(ctx.device)
        idx0 = self.all_idx[:args.update_batch_size]
        self.unit = UnitCosts(ctx, trainer.make_update_batch(ctx, self.rollout, self.prepared.cond,
                                                             self.prepared.advantages, idx0, vanilla_steps[idx0], 1),
                              vanilla_steps[idx0, 0], vanilla_steps[idx0, -1])
        self.rollout_times = []
        self.times = {m.name: [] for m in modes}
        self.monitor_times = {m.name: [] for m in modes if m.auto}
        self.replayed = {}   # a deferred mode's flush counts in the untimed run

    def _recorded_proxy(self, mode):
        """A deferred mode's proxy of the transformer, the bench's rollout re-run through it (the same
        generators: the same rollout), untimed, so that it knows the trajectories."""
        from ..deferred import wrap
        from .bench_modes import mode_config
        ctx, raw = self.ctx, self.ctx.transformer
        proxy = wrap(raw, mode_config(self.args, mode)).attach(ctx.optimizer)
        gen, _ = self.trainer.step_generators(ctx, 1)
        ctx.transformer = proxy
        try:
            self.trainer.sample_reference_model(ctx, self.prepared.cond, self.prepared.captions, gen)
        finally:
            ctx.transformer = raw
        return proxy

    def time_rollout(self):
        """The same rollout again, timed."""
        gen, _ = self.trainer.step_generators(self.ctx, 1)
        with Timer(self.ctx.device) as t:
            self.trainer.sample_reference_model(self.ctx, self.prepared.cond, self.prepared.captions, gen,
                                                keep_outputs=True)
        self.rollout_times.append(t.seconds)

    def run_update(self, mode):
        """Every sample's gradient, in GA blocks as training runs them: only the first block is
        on-policy (no optimizer step is taken here, so the parameters stay the rollout's). Returns
        the seconds the monitor took (an auto mode's run is a new step to it: it measures)."""
        ctx, args, prepared = self.ctx, self.args, self.prepared
        sel = self.selections["vanilla" if mode.vanilla or mode.deferred else "jagg"]
        ga = args.gradient_accumulation_steps
        if mode.auto:
            ctx.step += 1
        proxy, raw = self.proxies.get(mode.name), ctx.transformer
        monitor_s = 0.0
        try:
            if proxy is not None:
                proxy.note_fresh_rollout()
                ctx.transformer = proxy
            for block in range(0, self.num_samples, ga):
                stats = self.trainer.accumulate_policy_gradient(
                    ctx, self.rollout, prepared.cond, prepared.advantages, self.all_idx[block:block + ga],
                    sel.steps.to(ctx.device), ga * sel.num_train, self.updates[mode.name], on_policy=block == 0)
                monitor_s = max(monitor_s, stats.metrics.get("monitor_time_s", 0.0))   # the step's total so far
                if proxy is not None:   # where training's optimizer step would flush, and move the weights
                    proxy.flush()
                    proxy.note_step()
        finally:
            ctx.transformer = raw
        return monitor_s

    def time_modes(self):
        """Each mode's update, interleaved (the order rotates every repetition; rep 0 is warm-up),
        with the unit costs and the rollout timed after every repetition (the same machine load)."""
        args, modes = self.args, self.modes
        for rep in range(args.bench_reps + 1):
            for mode in modes[rep % len(modes):] + modes[:rep % len(modes)]:
                self.ctx.transformer.zero_grad(set_to_none=True)
                with Timer(self.ctx.device) as t:
                    monitor_s = self.run_update(mode)
                if rep > 0:
                    self.times[mode.name].append(t.seconds)
                    if mode.auto:
                        self.monitor_times[mode.name].append(monitor_s)
            self.unit.round(args.bench_unit_reps, record=rep > 0)
            if rep > 0:
                for _ in range(args.bench_rollout_reps):
                    self.time_rollout()
            self.ctx.transformer.train()

    def untimed_pass(self):
        """Each mode once more, untimed (the meter's hooks cost Python time per saved tensor): its
        activation peak, and under FSDP its collectives."""
        from dancegrpo.utils.activation_meter import ActivationMeter
        peaks, counted = {}, {}
        for mode in self.modes:
            self.ctx.transformer.zero_grad(set_to_none=True)
            flushed = len(self.proxies[mode.name].stats) if mode.deferred else 0
            with ActivationMeter() as meter, collectives(self.ctx) as counts:
                self.run_update(mode)
            peaks[mode.name] = meter.peak_mb
            if mode.deferred:
                self.replayed[mode.name] = replay_counts(self.proxies[mode.name].stats[flushed:])
            if counts is not None:
                counted[mode.name] = collective_summary(counts, self.num_samples, self.args.update_batch_size)
        self.ctx.transformer.zero_grad(set_to_none=True)
        self.ctx.counter.remove()
        for proxy in self.proxies.values():
            proxy.close()
        return peaks, counted


def run_benchmark(module, args):
    modes = parse_modes(args.bench_modes)
    bench = Bench(module, args, modes)
    bench.time_modes()
    peaks, counted = bench.untimed_pass()
    return summarize(bench, peaks, counted)


def _targets(args):
    """The caller's targets (the benchmark scripts own them): {"step": ..., "update": ...} and the
    paper's whole-step gain, each only where given."""
    targets = {name: value for name, value in (("step", args.bench_target_step), ("update", args.bench_target_update))
               if value is not None}
    return targets, args.bench_paper_step_gain


def summarize(bench, peaks, counted):
    """The raw numbers of the run (JSON-ready), each mode's summary, and the checks on the headline."""
    args, ctx, modes = bench.args, bench.ctx, bench.modes
    units = bench.unit.medians()
    rollout_s = statistics.median(bench.rollout_times)
    med = {name: statistics.median(ts) for name, ts in bench.times.items()}
    jagg_sel, num_transitions = bench.selections["jagg"], bench.num_transitions
    predicted = {m.name: predicted_seconds(args, bench.selections["vanilla" if m.vanilla else "jagg"],
                                           num_transitions, m, units) for m in modes if not m.auto}
    authors = {m.name: predicted_seconds(args, jagg_sel, num_transitions, m, units, "authors")
               for m in modes if m.name in ("jagg", "jagg_split", "endpoints")}
    names = [m.name for m in modes]
    headline = headline_mode(args, names, ctx.world_size)
    targets, paper_step_gain = _targets(args)
    result = dict(
        family=ctx.family.name, num_params=ctx.num_params, device=str(ctx.device), torch=torch.__version__,
        precision=describe_precision(ctx.device, args.mixed_precision),
        checkpointing=args.selective_checkpointing if args.gradient_checkpointing else 0.0,
        threads=torch.get_num_threads(), world_size=ctx.world_size, sampling_steps=args.sampling_steps,
        timestep_fraction=args.timestep_fraction, samples=bench.num_samples, update_batch_size=args.update_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        window=args.jagg_window, jagg_frac=args.jagg_frac, grouping=args.jagg_grouping, alpha=args.jagg_alpha,
        train_transitions=int((bench.selections["vanilla"].steps[0] >= 0).sum()),
        jagg_train_transitions=[int((row >= 0).sum()) for row in jagg_sel.steps],
        plan=[dict(size=g.size, jagg=g.jagg) for g in sample_groups(
            jagg_sel.steps[0].tolist(), num_transitions, args.jagg_window, args.jagg_frac, args.jagg_grouping)],
        reps=args.bench_reps, unit_costs_s=units, rollout_s=rollout_s, rollout_times_s=bench.rollout_times,
        update_median_s=med, update_times_s=bench.times, predicted_update_s=predicted,
        predicted_update_s_authors_schedule=authors, activation_peak_mb=peaks, fsdp_collectives=counted,
        plan_replay_rows=plan_replay_rows(jagg_sel.steps, num_transitions, args), deferred_replay=bench.replayed,
        headline=headline, paper_step_gain=paper_step_gain, targets=targets,
        sde_window_size=getattr(args, "sde_window_size", 0), modes={},
        monitor_every=args.jagg_monitor_every or AUTO_MONITOR_EVERY, monitor_times_s=bench.monitor_times)
    for mode in modes:
        if mode.auto:
            result["modes"][mode.name] = auto_summary(bench.updates[mode.name].routing, bench.times[mode.name],
                                                      bench.monitor_times[mode.name], rollout_s, med["vanilla"],
                                                      result["monitor_every"], peaks[mode.name])
        else:
            result["modes"][mode.name] = fixed_summary(med[mode.name], med["vanilla"], rollout_s, predicted,
                                                       mode.name, peaks[mode.name])
    if headline is not None:
        joint_calls = sum(g.jagg for row in jagg_sel.steps.tolist() for g in sample_groups(
            row, num_transitions, args.jagg_window, args.jagg_frac, args.jagg_grouping)) / args.update_batch_size
        result.update(checks(result, headline, joint_calls))
    return result


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    module, parser, rest = trainer_cli(argv, "jagg_patch.tools.bench_update", __doc__, add_bench_args)
    from dancegrpo.args import parse_args
    from dancegrpo.errors import exit_on_config_error
    args = parse_args(parser, rest)
    if args.jagg_frac == "auto":
        raise SystemExit("error: jagg_patch.tools.bench_update times the modes at a fixed --jagg_frac; time "
                         "--jagg_frac auto with a mode ending in _auto (--bench_modes vanilla,jagg_split_reuse_auto)")
    modes = parse_modes(args.bench_modes)   # before anything loads
    if any(m.deferred for m in modes) and args.jagg_grouping != "trained":
        raise SystemExit("error: the deferred modes group the transitions vanilla's update trains: time them with "
                         "--jagg_grouping trained")
    # the _auto modes route by --jagg_min_cos, though --jagg_frac is a fixed fraction
    check_trajectory(args, min_cos_used=any(m.auto for m in modes))
    result = exit_on_config_error(run_benchmark)(module, args)
    if launch_rank() != 0:
        return result
    report = format_report(result)
    print_and_write(report, result, args.bench_json, args.bench_md)
    return result


if __name__ == "__main__":
    main()
