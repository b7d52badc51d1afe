"""Update-phase micro-benchmark: vanilla vs the JAGG variants on ONE rollout, in ONE process.

    python -m jagg_patch.tools.bench_update dancegrpo.train_grpo_flux --preset small --output_dir runs/bench \\
        [--jagg_window 4] [--jagg_frac 0.6] [--jagg_grouping trained|window] [--jagg_alpha timestep|index] \\
        [--bench_reps 3] [--bench_unit_reps 5] [--bench_modes vanilla,jagg,jagg_split,exact,endpoints] \\
        [--bench_rollout_reps 2] [--bench_json F] [--bench_md F]
    torchrun --nproc_per_node=2 -m jagg_patch.tools.bench_update ...   # FSDP: also counts the collectives

Modes: vanilla (dancegrpo's own seams), jagg (joint backward), jagg_split (split backward),
jagg_batched (both endpoints in one forward), each also with _reuse (--jagg_reuse_rollout
on_policy: the first GA samples take their middle members' outputs from the rollout), exact
(per-step backward of the same groups) and endpoints (the ablation, joint backward). A JAGG mode
with _auto (jagg_auto, jagg_split_reuse_auto, ...) is --jagg_frac auto with the live fidelity
monitor measuring in every timed run (each run is a new training step to it, so the monitor's
passes are in every timing): its time splits into the monitor's (monitor_time_s) and the routed
update's, and its step ratio at the run's cadence, one measurement every --jagg_monitor_every steps
(10 when not given, as auto's default), is the routed update plus 1/N of the measurement. The JAGG
modes share --jagg_window / --jagg_frac / --jagg_alpha / --jagg_grouping; with the window grouping
they train the windows that grouping draws (vanilla keeps its own random subset). The checks are
made on the mode the configured --jagg_backward / --jagg_reuse_rollout run (the headline).
Under FSDP, the untimed pass also counts FSDP1's all-gathers and reduce-scatters per unit
(jagg_patch.tools.comm_count) and the most parameter bytes gathered at once.

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
ratio is given too. Two checks are printed, not asserted: measured update speedup >= 90% of the
predicted one, and whole-step speedup >= the paper's (18.3% Flux, 17.2% Qwen-Image).
"""
import contextlib
import statistics
import sys
import time

import torch

from dancegrpo.utils.launch import launch_rank
from dancegrpo.utils.precision import describe_precision

from ..cli import check_trajectory, trainer_cli
from .comm_count import count_collectives
from .reports import print_and_write
from ..core import resolve_backward
from ..plan import Group
from .cost_model import sample_groups, seconds, sum_passes
from ..config import AUTO_MONITOR_EVERY, JaggConfig
from ..update import make_policy_update, make_window_selection

PAPER_STEP_GAIN = {"flux": 0.183, "qwenimage": 0.172}
# The targets for the default (reuse on_policy, GA covering the rollout), CPU small preset.
TARGETS = {"flux": dict(step=0.25, update=0.40), "qwenimage": dict(step=0.172)}
# Flow-GRPO-Fast (--sde_window_size > 0): the paper's update-phase figure, 29.9-30.0%.
FAST_TARGETS = dict(update=0.299)


def _targets(args, family):
    """(targets, the paper's whole-step gain) for this algorithm and family."""
    if getattr(args, "sde_window_size", 0):
        return FAST_TARGETS, None
    return TARGETS.get(family, {}), PAPER_STEP_GAIN.get(family)
ALL_MODES = ("vanilla", "jagg", "jagg_split", "jagg_batched", "jagg_reuse", "jagg_split_reuse", "jagg_batched_reuse",
             "exact", "endpoints")
# bench mode -> (JAGG mode, backward form, rollout reuse)
JAGG_VARIANTS = {"jagg": ("jagg", "joint", "off"), "jagg_split": ("jagg", "split", "off"),
                 "jagg_batched": ("jagg", "batched", "off"),
                 "jagg_reuse": ("jagg", "joint", "on_policy"), "jagg_split_reuse": ("jagg", "split", "on_policy"),
                 "jagg_batched_reuse": ("jagg", "batched", "on_policy"),
                 "exact": ("exact", "joint", "off"), "endpoints": ("endpoints", "joint", "off")}
AUTO_SUFFIX = "_auto"   # a JAGG mode routed by --jagg_frac auto, its monitor measuring in every timed run


def _variant(mode):
    """(JAGG mode, backward form, rollout reuse, auto) of a bench mode other than vanilla; None if unknown."""
    base, auto = (mode[:-len(AUTO_SUFFIX)], True) if mode.endswith(AUTO_SUFFIX) else (mode, False)
    if base not in JAGG_VARIANTS or (auto and JAGG_VARIANTS[base][0] != "jagg"):
        return None
    return (*JAGG_VARIANTS[base], auto)


def _make_update(args, mode):
    jagg_mode, backward, reuse, auto = _variant(mode)
    config = JaggConfig(window=args.jagg_window, jagg_frac="auto" if auto else args.jagg_frac, mode=jagg_mode,
                        alpha=args.jagg_alpha, backward=backward, grouping=args.jagg_grouping, reuse=reuse,
                        monitor_every=1 if auto else 0, monitor_samples=args.jagg_monitor_samples,
                        min_cos=args.jagg_min_cos)
    return make_policy_update(config)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    def __init__(self, device):
        self.device = device

    def __enter__(self):
        _sync(self.device)
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        _sync(self.device)
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


def _selections(ctx, args, prepared):
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


def _predicted(args, selection, num_transitions, mode, units, schedule="project"):
    """Update seconds of every sample's groups from the unit costs (per micro-batch of
    --update_batch_size samples, so per sample / update_batch_size). A reuse mode's on-policy
    samples (the first GA) take the "reuse" schedule."""
    passes = [0, 0, 0]
    jagg_mode, _, reuse = JAGG_VARIANTS.get(mode, ("exact", "joint", "off"))
    for i_sample, row in enumerate(selection.steps.tolist()):
        if mode == "vanilla":
            groups = [Group(0, (k,), False) for k in row if k >= 0]
        else:
            groups = sample_groups(row, num_transitions, args.jagg_window, args.jagg_frac, args.jagg_grouping)
        on_policy = i_sample < args.gradient_accumulation_steps
        sample_schedule = "reuse" if reuse != "off" and on_policy and schedule == "project" else schedule
        for i, n in enumerate(sum_passes(groups, jagg_mode, sample_schedule)):
            passes[i] += n
    return seconds(passes, units["f_grad"], units["f_nograd"], units["backward"]) / args.update_batch_size


@contextlib.contextmanager
def _collectives(ctx):
    """FSDP1's or FSDP2's all-gathers and reduce-scatters per unit while the block runs (None without
    FSDP)."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel as FSDP
    if not isinstance(ctx.transformer, (FSDP, FSDPModule)):
        yield None
        return
    with count_collectives(ctx.transformer) as counts:
        yield counts


def _collective_summary(counts, num_samples, micro_batch):
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


def run_benchmark(module, args):
    from dancegrpo import trainer
    from dancegrpo.algo.grpo import policy_update as vanilla_update
    from dancegrpo.utils.activation_meter import ActivationMeter
    modes = [m.strip() for m in args.bench_modes.split(",") if m.strip()]
    bad = [m for m in modes if m != "vanilla" and _variant(m) is None]
    if bad or "vanilla" not in modes:
        raise SystemExit(f"error: --bench_modes must include vanilla and come from {ALL_MODES} (a JAGG mode may "
                         f"end in {AUTO_SUFFIX}), got {modes}")
    ctx = trainer.setup(args, module.FAMILY(args))
    prepared = trainer.prepare_update(ctx, keep_outputs=True, step=1)   # the rollout is also the warm-up
    cond, captions, rollout, advantages = prepared.cond, prepared.captions, prepared.rollout, prepared.advantages
    rollout_times = []

    def time_rollout():
        gen, _ = trainer.step_generators(ctx, 1)  # the same rollout again
        with Timer(ctx.device) as t:
            trainer.sample_reference_model(ctx, cond, captions, gen, keep_outputs=True)
        rollout_times.append(t.seconds)

    num_samples, num_transitions = rollout.log_probs.shape[0], rollout.log_probs.shape[1] - 1
    selections = _selections(ctx, args, prepared)
    all_idx = torch.arange(num_samples, device=ctx.device)
    ctx.transformer.train()
    updates = {mode: vanilla_update if mode == "vanilla" else _make_update(args, mode) for mode in modes}
    auto_modes = [m for m in modes if m != "vanilla" and _variant(m)[3]]

    def run_update(mode):
        """Every sample's gradient, in GA blocks as training runs them: only the first block is
        on-policy (no optimizer step is taken here, so the parameters stay the rollout's). Returns
        the seconds the monitor took (an auto mode's run is a new step to it: it measures)."""
        sel = selections["vanilla" if mode == "vanilla" else "jagg"]
        ga = args.gradient_accumulation_steps
        if mode in auto_modes:
            ctx.step += 1
        monitor_s = 0.0
        for block in range(0, num_samples, ga):
            stats = trainer.accumulate_policy_gradient(ctx, rollout, cond, advantages, all_idx[block:block + ga],
                                                       sel.steps.to(ctx.device), ga * sel.num_train, updates[mode],
                                                       on_policy=block == 0)
            monitor_s = max(monitor_s, stats.metrics.get("monitor_time_s", 0.0))   # the step's total so far
        return monitor_s

    vanilla_steps = selections["vanilla"].steps.to(ctx.device)
    idx0 = all_idx[:args.update_batch_size]
    unit = UnitCosts(ctx, trainer.make_update_batch(ctx, rollout, cond, advantages, idx0, vanilla_steps[idx0], 1),
                     vanilla_steps[idx0, 0], vanilla_steps[idx0, -1])
    times, monitor_times = {m: [] for m in modes}, {m: [] for m in auto_modes}
    for rep in range(args.bench_reps + 1):  # rep 0 is warm-up, not recorded
        order = modes[rep % len(modes):] + modes[:rep % len(modes)]
        for mode in order:
            ctx.transformer.zero_grad(set_to_none=True)
            with Timer(ctx.device) as t:
                monitor_s = run_update(mode)
            if rep > 0:
                times[mode].append(t.seconds)
                if mode in auto_modes:
                    monitor_times[mode].append(monitor_s)
        unit.round(args.bench_unit_reps, record=rep > 0)
        if rep > 0:
            for _ in range(args.bench_rollout_reps):
                time_rollout()
        ctx.transformer.train()
    peaks, collectives = {}, {}
    for mode in modes:  # untimed: the meter's hooks cost Python time per saved tensor
        ctx.transformer.zero_grad(set_to_none=True)
        with ActivationMeter() as meter, _collectives(ctx) as counts:
            run_update(mode)
        peaks[mode] = meter.peak_mb
        if counts is not None:
            collectives[mode] = _collective_summary(counts, num_samples, args.update_batch_size)
    ctx.transformer.zero_grad(set_to_none=True)
    ctx.counter.remove()
    units = unit.medians()

    rollout_s = statistics.median(rollout_times)
    med = {m: statistics.median(ts) for m, ts in times.items()}
    predicted = {m: _predicted(args, selections["vanilla" if m == "vanilla" else "jagg"], num_transitions, m, units)
                 for m in modes if m not in auto_modes}
    authors = {m: _predicted(args, selections["jagg"], num_transitions, m, units, "authors")
               for m in modes if m in ("jagg", "jagg_split", "endpoints")}
    family = ctx.family.name
    jagg_sel = selections["jagg"]
    headline = headline_mode(args, modes, ctx.world_size)
    targets, paper_step_gain = _targets(args, family)
    result = dict(
        family=family, num_params=ctx.num_params, device=str(ctx.device), torch=torch.__version__,
        precision=describe_precision(ctx.device, args.mixed_precision),
        checkpointing=args.selective_checkpointing if args.gradient_checkpointing else 0.0,
        threads=torch.get_num_threads(), world_size=ctx.world_size, sampling_steps=args.sampling_steps,
        timestep_fraction=args.timestep_fraction, samples=num_samples, update_batch_size=args.update_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        window=args.jagg_window, jagg_frac=args.jagg_frac, grouping=args.jagg_grouping, alpha=args.jagg_alpha,
        train_transitions=int((selections["vanilla"].steps[0] >= 0).sum()),
        jagg_train_transitions=[int((row >= 0).sum()) for row in jagg_sel.steps],
        plan=[dict(size=g.size, jagg=g.jagg) for g in sample_groups(
            jagg_sel.steps[0].tolist(), num_transitions, args.jagg_window, args.jagg_frac, args.jagg_grouping)],
        reps=args.bench_reps, unit_costs_s=units, rollout_s=rollout_s, rollout_times_s=rollout_times,
        update_median_s=med, update_times_s=times, predicted_update_s=predicted,
        predicted_update_s_authors_schedule=authors, activation_peak_mb=peaks, fsdp_collectives=collectives,
        headline=headline, paper_step_gain=paper_step_gain, targets=targets,
        sde_window_size=getattr(args, "sde_window_size", 0), modes={},
        monitor_every=args.jagg_monitor_every or AUTO_MONITOR_EVERY, monitor_times_s=monitor_times)
    for mode in modes:
        if mode in auto_modes:
            result["modes"][mode] = _auto_summary(updates[mode].routing, times[mode], monitor_times[mode], rollout_s,
                                                  med["vanilla"], result["monitor_every"], peaks[mode])
            continue
        result["modes"][mode] = dict(update_s=med[mode], update_gain=gain(med[mode], med["vanilla"]),
                                     update_ratio=med["vanilla"] / med[mode], step_s=rollout_s + med[mode],
                                     step_gain=gain(rollout_s + med[mode], rollout_s + med["vanilla"]),
                                     predicted_update_s=predicted[mode],
                                     predicted_update_gain=gain(predicted[mode], predicted["vanilla"]),
                                     predicted_step_gain=gain(rollout_s + predicted[mode],
                                                              rollout_s + predicted["vanilla"]),
                                     activation_peak_mb=peaks[mode])
    if headline is not None:
        joint_calls = sum(g.jagg for row in jagg_sel.steps.tolist() for g in sample_groups(
            row, num_transitions, args.jagg_window, args.jagg_frac, args.jagg_grouping)) / args.update_batch_size
        result.update(_checks(result, headline, joint_calls))
    return result


def _auto_summary(routing, times, monitor_times, rollout_s, vanilla_s, every, peak_mb):
    """An auto mode's numbers: its timed runs measured in full; the routed update is each run less
    its monitor's seconds, and the step at the run's cadence adds 1/every of the measurement."""
    update_s = statistics.median(times)
    monitor_s = statistics.median(monitor_times)
    routed_s = statistics.median([t - m for t, m in zip(times, monitor_times)])
    cadence_s = routed_s + monitor_s / every
    return dict(update_s=update_s, update_gain=gain(update_s, vanilla_s), update_ratio=vanilla_s / update_s,
                step_s=rollout_s + update_s, step_gain=gain(rollout_s + update_s, rollout_s + vanilla_s),
                predicted_update_s=None, activation_peak_mb=peak_mb, monitor_s=monitor_s, routed_update_s=routed_s,
                cadence_step_s=rollout_s + cadence_s,
                cadence_step_ratio=(rollout_s + cadence_s) / (rollout_s + vanilla_s),
                routed=sorted(routing.routed), smoothed_cos={p: routing.smoothed[p] for p in sorted(routing.smoothed)})


def headline_mode(args, modes, world_size):
    """The bench mode that runs what the configured --jagg_backward / --jagg_reuse_rollout run."""
    backward = resolve_backward(args.jagg_backward, world_size)
    name = {"joint": "jagg", "split": "jagg_split", "batched": "jagg_batched"}[backward]
    name += "" if args.jagg_reuse_rollout == "off" else "_reuse"
    return name if name in modes else ("jagg" if "jagg" in modes else None)


def _checks(r, headline, joint_calls):
    """The targets, evaluated on the headline mode (printed, never asserted)."""
    h, u = r["modes"][headline], r["unit_costs_s"]
    pred_gain = h["predicted_update_gain"]
    out = dict(predicted_update_gain=pred_gain, predicted_step_gain=h["predicted_step_gain"],
               measured_vs_predicted=h["update_gain"] / pred_gain if pred_gain > 0 else float("nan"))
    out["check_update_95pct_of_predicted"] = bool(out["measured_vs_predicted"] >= 0.95)
    paper = r["paper_step_gain"]
    out["check_step_gain_vs_paper"] = None if paper is None else bool(h["step_gain"] >= paper)
    targets = r["targets"]
    out["check_step_gain_target"] = bool(h["step_gain"] >= targets["step"]) if "step" in targets else None
    out["check_update_gain_target"] = bool(h["update_gain"] >= targets["update"]) if "update" in targets else None
    out["activation_peak_vs_vanilla"] = h["activation_peak_mb"] / r["modes"]["vanilla"]["activation_peak_mb"]
    if JAGG_VARIANTS[headline][1] == "joint":
        # The prediction with the measured joint backward B2 instead of 2 B: an explanation of a gap.
        pj2 = h["predicted_update_s"] + joint_calls * (u["joint_backward_2"] - 2 * u["backward"])
        out["predicted_update_gain_measured_b2"] = gain(pj2, r["predicted_update_s"]["vanilla"])
    return out


def _met(flag):
    return "MET" if flag else "NOT MET"


def _collective_lines(r):
    if not r["fsdp_collectives"]:
        return []
    lines = ["", f"FSDP1 collectives during the update ({r['world_size']} ranks, rank 0; per micro-batch of "
             f"{r['update_batch_size']}, FULL_SHARD gathers a unit for each forward and each backward call):", "",
             "| mode | all-gathers / block unit | root unit | reduce-scatters / unit | most units gathered at once "
             "| their MB |", "|---|---|---|---|---|---|"]
    for mode, c in r["fsdp_collectives"].items():
        lines.append(f"| {mode} | {c['all_gathers_per_block_unit_per_micro_batch']:g} | "
                     f"{c['root_all_gathers_per_micro_batch']:g} "
                     f"| {c['reduce_scatters_per_unit_per_micro_batch']:g} | {c['peak_gathered_units']} of "
                     f"{c['units']} | {c['peak_gathered_mb']:.1f} |")
    return lines


def _auto_lines(r):
    autos = {mode: m for mode, m in r["modes"].items() if "monitor_s" in m}
    if not autos:
        return []
    vanilla_step = r["modes"]["vanilla"]["step_s"]
    lines = ["", f"--jagg_frac auto (the _auto modes): every timed run above measured (the monitor at every step); "
             f"at one measurement every {r['monitor_every']} steps a step costs the routed update plus "
             f"1/{r['monitor_every']} of the monitor:", "",
             "| mode | monitor s | routed update s | step s at that cadence | step / vanilla's | positions routed "
             "to JAGG (smoothed cos) |", "|---|---|---|---|---|---|"]
    for mode, m in autos.items():
        cos = ", ".join(f"g{p} {c:.3f}" for p, c in m["smoothed_cos"].items())
        lines.append(f"| {mode} | {m['monitor_s']:.3f} | {m['routed_update_s']:.3f} | {m['cadence_step_s']:.3f} | "
                     f"{m['cadence_step_ratio']:.2f} (vanilla {vanilla_step:.3f} s) | {m['routed']} ({cos}) |")
    return lines


def _checkpointing_text(fraction):
    if not fraction:
        return "no gradient checkpointing"
    return "gradient checkpointing" + ("" if fraction == 1 else f" of {fraction:g} of the blocks")


def format_report(r):
    u = r["unit_costs_s"]
    plan = ", ".join(f"{g['size']}{'J' if g['jagg'] else 'E'}" for g in r["plan"])
    counts = sorted(set(r["jagg_train_transitions"]))
    lines = [
        f"## Update-phase micro-benchmark: {r['family']} ({r['num_params'] / 1e6:.1f}M params, {r['device']}, "
        f"torch {r['torch']}, {r['threads']} threads, {r['world_size']} rank(s), {r.get('precision', 'float32')}, "
        f"{_checkpointing_text(r.get('checkpointing', 0.0))})",
        "",
        f"S={r['sampling_steps']}, timestep_fraction {r['timestep_fraction']} -> vanilla trains "
        f"{r['train_transitions']} transitions/sample, the JAGG modes {'/'.join(map(str, counts))}; "
        f"{r['samples']} samples, update micro-batch {r['update_batch_size']}, GA {r['gradient_accumulation_steps']} "
        f"(the _reuse modes take the rollout's outputs for the first GA samples only); W={r['window']}, "
        f"jagg_frac {r['jagg_frac']}, grouping {r['grouping']}, alpha "
        f"{r['alpha']} -> groups of sample 0 [{plan}] (J = JAGG, E = exact); {r['reps']} interleaved reps, medians.",
        "",
        f"Unit costs per micro-batch: F_grad {u['f_grad'] * 1e3:.1f} ms, F_nograd {u['f_nograd'] * 1e3:.1f} ms, "
        f"B {u['backward'] * 1e3:.1f} ms, joint B of 2 graphs {u['joint_backward_2'] * 1e3:.1f} ms "
        f"({u['joint_backward_2'] / u['backward']:.2f} B); B = {u['backward'] / u['f_grad']:.2f} F_grad"
        f"{' (with the recompute of its forward)' if r.get('checkpointing') else ''}. Rollout {r['rollout_s']:.3f} s.",
        "",
        "| mode | update s | predicted s | authors' schedule s | update speedup | ratio | step s (rollout + update) "
        "| step speedup | activation peak MB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, m in r["modes"].items():
        authors = r["predicted_update_s_authors_schedule"].get(mode)
        predicted = "-" if m["predicted_update_s"] is None else f"{m['predicted_update_s']:.3f}"
        lines.append(f"| {mode} | {m['update_s']:.3f} | {predicted} | "
                     f"{'-' if authors is None else f'{authors:.3f}'} | {100 * m['update_gain']:+.1f}% | "
                     f"{m['update_ratio']:.2f}x | {m['step_s']:.3f} | {100 * m['step_gain']:+.1f}% | "
                     f"{m['activation_peak_mb']:.2f} |")
    lines += ["", "predicted: this project's passes (JAGG 2 F_g + (w-2) F_ng + 2 B per group; with reuse 2 F_g + 2 B "
              "for on-policy samples) from the unit costs; authors' schedule: the same groups with every member "
              "forwarded without grad first (w F_ng + 2 F_g + 2 B per JAGG group). Activation peak: tensors saved "
              "for backward (dancegrpo.utils.activation_meter.ActivationMeter)."]
    lines += _auto_lines(r)
    lines += _collective_lines(r)
    h = r.get("headline")
    if h is None:
        return "\n".join(lines)
    m, t = r["modes"][h], r["targets"]
    lines += [
        "",
        f"Checks on {h} (what the configured --jagg_backward / --jagg_reuse_rollout run):",
        f"- predicted from unit costs: update {100 * r['predicted_update_gain']:+.1f}%, whole step "
        f"{100 * r['predicted_step_gain']:+.1f}%; measured update {100 * m['update_gain']:+.1f}% is "
        f"{100 * r['measured_vs_predicted']:.0f}% of it (target >= 95%): {_met(r['check_update_95pct_of_predicted'])}",
    ]
    if "predicted_update_gain_measured_b2" in r:
        lines.append(f"  (with the measured joint backward B2 = {u['joint_backward_2'] / u['backward']:.2f} B instead "
                     f"of 2 B the prediction is {100 * r['predicted_update_gain_measured_b2']:+.1f}%)")
    if r["check_update_gain_target"] is not None:
        what = " (the paper's Flow-GRPO-Fast figure)" if r.get("sde_window_size") else ""
        lines.append(f"- update speedup {100 * m['update_gain']:+.1f}% (target >= {100 * t['update']:.1f}%{what}): "
                     f"{_met(r['check_update_gain_target'])}")
    if r["check_step_gain_target"] is not None:
        lines.append(f"- whole-step speedup {100 * m['step_gain']:+.1f}% (target >= {100 * t['step']:.1f}%; the "
                     f"paper {100 * r['paper_step_gain']:.1f}%): {_met(r['check_step_gain_target'])} (rollout is "
                     f"{100 * r['rollout_s'] / r['modes']['vanilla']['step_s']:.0f}% of the vanilla step here)")
    else:
        lines.append(f"- whole-step speedup {100 * m['step_gain']:+.1f}% (rollout is "
                     f"{100 * r['rollout_s'] / r['modes']['vanilla']['step_s']:.0f}% of the vanilla step here)")
    lines.append(f"- activation peak {r['activation_peak_vs_vanilla']:.2f} x vanilla's (target <= 1.05): "
                 f"{_met(r['activation_peak_vs_vanilla'] <= 1.05)}")
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    module, parser, rest = trainer_cli(argv, "jagg_patch.tools.bench_update", __doc__)
    from dancegrpo.args import parse_args
    from dancegrpo.errors import exit_on_config_error
    g = parser.add_argument_group("benchmark")
    g.add_argument("--bench_reps", type=int, default=3, help="Timed repetitions of each mode (after one warm-up).")
    g.add_argument("--bench_unit_reps", type=int, default=3,
                   help="Unit-cost measurements after each repetition of the modes.")
    g.add_argument("--bench_rollout_reps", type=int, default=1,
                   help="Timed rollouts after each repetition of the modes (median over all).")
    g.add_argument("--bench_modes", default=",".join(ALL_MODES), help="Comma list; vanilla is the reference.")
    g.add_argument("--bench_json", default=None, help="Write the raw numbers here (JSON).")
    g.add_argument("--bench_md", default=None, help="Write the report here (markdown).")
    args = parse_args(parser, rest)
    if args.jagg_frac == "auto":
        raise SystemExit("error: jagg_patch.tools.bench_update times the modes at a fixed --jagg_frac; time "
                         "--jagg_frac auto with a mode ending in _auto (--bench_modes vanilla,jagg_split_reuse_auto)")
    # the _auto modes route by --jagg_min_cos, though --jagg_frac is a fixed fraction
    check_trajectory(args, min_cos_used=any(m.endswith(AUTO_SUFFIX) for m in args.bench_modes.split(",")))
    result = exit_on_config_error(run_benchmark)(module, args)
    if launch_rank() != 0:
        return result
    report = format_report(result)
    print_and_write(report, result, args.bench_json, args.bench_md)
    return result


if __name__ == "__main__":
    main()
