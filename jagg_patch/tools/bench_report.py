"""The report of jagg_patch.tools.bench_update: the checks on the headline mode against the targets the
caller gives (the benchmark scripts own them), and the markdown tables."""
import statistics

from .bench_modes import MODES
from .bench_timing import gain

# What the report checks whatever the caller's targets: a model of the update that explains 95% of its
# measured speedup, and JAGG's activations within 5% of vanilla's.
MEASURED_OF_PREDICTED, ACTIVATION_PEAK_RATIO = 0.95, 1.05


def checks(r, headline, joint_calls):
    """The targets, evaluated on the headline mode (printed, never asserted)."""
    h, u = r["modes"][headline], r["unit_costs_s"]
    pred_gain = h["predicted_update_gain"]
    out = dict(predicted_update_gain=pred_gain, predicted_step_gain=h["predicted_step_gain"],
               measured_vs_predicted=h["update_gain"] / pred_gain if pred_gain > 0 else float("nan"))
    out["check_update_95pct_of_predicted"] = bool(out["measured_vs_predicted"] >= MEASURED_OF_PREDICTED)
    paper = r["paper_step_gain"]
    out["check_step_gain_vs_paper"] = None if paper is None else bool(h["step_gain"] >= paper)
    targets = r["targets"]
    out["check_step_gain_target"] = bool(h["step_gain"] >= targets["step"]) if "step" in targets else None
    out["check_update_gain_target"] = bool(h["update_gain"] >= targets["update"]) if "update" in targets else None
    out["activation_peak_vs_vanilla"] = h["activation_peak_mb"] / r["modes"]["vanilla"]["activation_peak_mb"]
    if MODES[headline].backward == "joint":
        # The prediction with the measured joint backward B2 instead of 2 B: an explanation of a gap.
        pj2 = h["predicted_update_s"] + joint_calls * (u["joint_backward_2"] - 2 * u["backward"])
        out["predicted_update_gain_measured_b2"] = gain(pj2, r["predicted_update_s"]["vanilla"])
    return out


def fixed_summary(update_s, vanilla_s, rollout_s, predicted, name, peak_mb):
    return dict(update_s=update_s, update_gain=gain(update_s, vanilla_s), update_ratio=vanilla_s / update_s,
                step_s=rollout_s + update_s, step_gain=gain(rollout_s + update_s, rollout_s + vanilla_s),
                predicted_update_s=predicted[name], predicted_update_gain=gain(predicted[name], predicted["vanilla"]),
                predicted_step_gain=gain(rollout_s + predicted[name], rollout_s + predicted["vanilla"]),
                activation_peak_mb=peak_mb)


def auto_summary(routing, times, monitor_times, rollout_s, vanilla_s, every, peak_mb):
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


def _replay_lines(r):
    if not r.get("deferred_replay"):
        return []
    lines = ["", f"Deferred flushes (the untimed run): rows replayed with grad against the restated plan's "
                 f"{r['plan_replay_rows']} (two per JAGG group, every member of an exact one):", ""]
    for mode, c in r["deferred_replay"].items():
        same = c["rows"] + c["zero_rows"] == r["plan_replay_rows"] and not c["unplanned_exact_rows"]
        lines.append(f"- {mode}: {c['rows']} replayed + {c['zero_rows']} with a zero signal skipped, in "
                     f"{c['backwards']} backwards; rows trained exactly outside the plan {c['unplanned_exact_rows']}: "
                     f"{'the restated plan' if same else 'NOT the restated plan'}")
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
              "forwarded without grad first (w F_ng + 2 F_g + 2 B per JAGG group); deferred: vanilla's update through "
              "jagg_patch.deferred's proxy, every member called without grad (w F_ng; with reuse none for on-policy "
              "samples), then 2 F_g + 2 B per JAGG group at the flush. Activation peak: tensors saved "
              "for backward (dancegrpo.utils.activation_meter.ActivationMeter)."]
    lines += _auto_lines(r)
    lines += _collective_lines(r)
    lines += _replay_lines(r)
    h = r.get("headline")
    if h is None:
        return "\n".join(lines)
    m, t = r["modes"][h], r["targets"]
    lines += [
        "",
        f"Checks on {h} (what the configured --jagg_backward / --jagg_reuse_rollout run):",
        f"- predicted from unit costs: update {100 * r['predicted_update_gain']:+.1f}%, whole step "
        f"{100 * r['predicted_step_gain']:+.1f}%; measured update {100 * m['update_gain']:+.1f}% is "
        f"{100 * r['measured_vs_predicted']:.0f}% of it (target >= {100 * MEASURED_OF_PREDICTED:.0f}%): "
        f"{_met(r['check_update_95pct_of_predicted'])}",
    ]
    if "predicted_update_gain_measured_b2" in r:
        lines.append(f"  (with the measured joint backward B2 = {u['joint_backward_2'] / u['backward']:.2f} B instead "
                     f"of 2 B the prediction is {100 * r['predicted_update_gain_measured_b2']:+.1f}%)")
    if r["check_update_gain_target"] is not None:
        what = " (the paper's Flow-GRPO-Fast figure)" if r.get("sde_window_size") else ""
        lines.append(f"- update speedup {100 * m['update_gain']:+.1f}% (target >= {100 * t['update']:.1f}%{what}): "
                     f"{_met(r['check_update_gain_target'])}")
    if r["check_step_gain_target"] is not None:
        paper = "" if r["paper_step_gain"] is None else f"; the paper {100 * r['paper_step_gain']:.1f}%"
        lines.append(f"- whole-step speedup {100 * m['step_gain']:+.1f}% (target >= {100 * t['step']:.1f}%{paper}): "
                     f"{_met(r['check_step_gain_target'])} (rollout is "
                     f"{100 * r['rollout_s'] / r['modes']['vanilla']['step_s']:.0f}% of the vanilla step here)")
    else:
        lines.append(f"- whole-step speedup {100 * m['step_gain']:+.1f}% (rollout is "
                     f"{100 * r['rollout_s'] / r['modes']['vanilla']['step_s']:.0f}% of the vanilla step here)")
    lines.append(f"- activation peak {r['activation_peak_vs_vanilla']:.2f} x vanilla's (target <= "
                 f"{ACTIVATION_PEAK_RATIO:g}): {_met(r['activation_peak_vs_vanilla'] <= ACTIVATION_PEAK_RATIO)}")
    return "\n".join(lines)
