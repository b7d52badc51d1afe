"""The table that decides how to use JAGG: quality against whole-step time, one row per configuration.

    python -m jagg_patch.tools.tradeoff QUALITY_ROOT --bench VARIANT=BENCH_JSON:MODE [--bench ...] \\
        [--metric digit_heldout] [--tolerance_sd 1] [--goal_ratio 0.6] [--out DIR] [--title T]

QUALITY_ROOT is one family's quality folder as benchmarks/digits.sh lays it out: report/report.json
(jagg_patch.tools.quality_report: the held-out metric at the last evaluated step per seed) and
seed<S>/<variant>/metrics.jsonl (the training runs). Each --bench names the jagg_patch.tools.bench_update
JSON that timed a variant side by side with vanilla in one process, and the bench mode that runs
what the variant's training runs ran; the ratio is that mode's whole step (rollout + update) over
vanilla's in the same JSON, and for a mode with `_auto` the step at the run's monitoring cadence (the
routed update plus 1/N of one measurement). vanilla is 1 by definition and needs no --bench.

Per variant: the metric (mean ± sd over seeds), the step-time ratio, the backwards per step (median
over the runs), and for a variant whose runs routed with --jagg_frac auto, the routing it chose and
the steps at which it changed, per seed (the `jagg_routed` bitmask of the metrics records), and the
range of the cosines its monitor measured per position (`jagg_cos/g<p>`). Then the
verdicts: the fastest variant whose mean is within --tolerance_sd of vanilla's seed-sd below vanilla's
mean, whether it meets --goal_ratio, and for each window whether auto is faster than every fixed
fraction of that window at equal quality. A step counts as faster than another only by more than
both benches' repetition spreads (half the range of the timed updates over vanilla's step, shown
as the ratio's ±): auto trains a fixed fraction's runs bit for bit when it routes the same, and a
0.01 between their medians is timing noise, not a verdict. Writes tradeoff.{md,json} and
pareto.png (metric against the ratio, seeds' sd and the ratio's spread as error bars) under --out.
"""
import math
import os
import re

from dancegrpo.utils.plots import save_figure

from dancegrpo.errors import exit_on_config_error
from dancegrpo.utils.atomic import write_text
from dancegrpo.utils.command_line import CommandParser

from .run_records import CompareError, load_metrics, read_json
from .reports import json_text, output_errors

WINDOW = re.compile(r"(?:^|_)w(\d+)(?:_|$)")


def parse_bench(spec):
    """'VARIANT=PATH:MODE' -> (variant, path, mode)."""
    variant, sep, rest = spec.partition("=")
    path, sep2, mode = rest.rpartition(":")
    if not (sep and sep2 and variant and path and mode):
        raise CompareError(f"--bench {spec!r}: expected VARIANT=BENCH_JSON:MODE (e.g. jagg=speed/jagg.json:jagg_split_reuse)")
    return variant, path, mode


def _half_range(times):
    return (max(times) - min(times)) / 2 if times else 0.0


def step_ratio(path, mode):
    """(ratio, spread) from one bench_update JSON: whole-step time of `mode` over vanilla's, and half
    the range of both updates' timed repetitions over vanilla's step (what the ratio moves by between
    repetitions; 0 where the JSON records none)."""
    rerun = f"run python -m jagg_patch.tools.bench_update ... --bench_json {path}"
    if not os.path.isfile(path):
        raise CompareError(f"{path!r} not found: {rerun}")
    bench = read_json(path, rerun)
    modes = bench.get("modes") if isinstance(bench, dict) else None
    if not isinstance(modes, dict):
        raise CompareError(f"{path!r} is not a bench_update JSON (no 'modes'): {rerun}")
    if mode not in modes or "vanilla" not in modes:
        raise CompareError(f"{path!r} has modes {sorted(modes)}; it needs vanilla and {mode!r}")
    vanilla, m = _seconds(modes["vanilla"], "step_s", path), modes[mode]
    reps = bench.get("update_times_s", {})
    spread = (_half_range(reps.get(mode, [])) + _half_range(reps.get("vanilla", []))) / vanilla
    return _seconds(m, "cadence_step_s" if "cadence_step_s" in m else "step_s", path) / vanilla, spread


def _seconds(mode_times, field, path):
    """A timed mode's seconds: a positive finite number, or one line (a ratio needs one)."""
    value = mode_times.get(field) if isinstance(mode_times, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise CompareError(f"{path!r}: {field} is {value!r}, not a positive time; the bench did not time this mode")
    return float(value)


def routing_history(records):
    """[(step, [routed positions])] at the first record and at every change of the routing; [] when
    the run never routed by measurement."""
    history = []
    for r in records:
        if "jagg_routed" not in r:
            continue
        routed = [p for p in range(int(r["jagg_routed"]).bit_length()) if int(r["jagg_routed"]) >> p & 1]
        if not history or history[-1][1] != routed:
            history.append((r["step"], routed))
    return history


def measured_cos(records):
    """{position: (lowest, highest)} of the cosines the live monitor measured (jagg_cos/g<p>)."""
    seen = {}
    for r in records:
        for key, value in r.items():
            if key.startswith("jagg_cos/g") and value == value:   # NaN: nothing to compare there
                seen.setdefault(int(key[len("jagg_cos/g"):]), []).append(value)
    return {p: (min(v), max(v)) for p, v in sorted(seen.items())}


def describe_cos(per_seed):
    """'g0 0.985-0.991, g1 ...' over every seed's measurements."""
    merged = {}
    for spans in per_seed.values():
        for p, (low, high) in spans.items():
            old = merged.get(p, (low, high))
            merged[p] = (min(old[0], low), max(old[1], high))
    return ", ".join(f"g{p} {low:.3f}-{high:.3f}" for p, (low, high) in merged.items())


def describe_routing(per_seed):
    """One cell: the routing history, once if every seed's is the same, else per seed."""
    def one(history):
        return "; ".join(f"step {s}: {positions or 'none'}" for s, positions in history)
    texts = {seed: one(h) for seed, h in per_seed.items() if h}
    if not texts:
        return ""
    if len(set(texts.values())) == 1 and len(texts) == len(per_seed):
        return next(iter(texts.values())) + " (every seed)"
    return " | ".join(f"seed {seed}: {t}" for seed, t in texts.items())


def collect(root, benches, metric):
    """One row per variant of the quality report, with its ratio, backwards and routing."""
    report_path = os.path.join(root, "report", "report.json")
    if not os.path.isfile(report_path):
        raise CompareError(f"{report_path!r} not found: run python -m jagg_patch.tools.quality_report {root} "
                           f"--metric {metric} --out {os.path.join(root, 'report')}")
    report = read_json(report_path, f"run python -m jagg_patch.tools.quality_report {root} --metric {metric} "
                                    f"--out {os.path.join(root, 'report')}")
    rows = report.get("rows") if isinstance(report, dict) else None
    if not isinstance(rows, list) or not all(isinstance(r, dict) and "variant" in r for r in rows):
        raise CompareError(f"{report_path!r} is not a quality_report JSON (no 'rows' of variants)")
    quality = {r["variant"]: r for r in rows}
    if "vanilla" not in quality:
        raise CompareError(f"{report_path!r} has no vanilla row: the ratios and the tolerance are vanilla's")
    missing = sorted(set(quality) - set(benches) - {"vanilla", "control"})
    if missing:
        raise CompareError(f"no --bench for {', '.join(missing)}: each variant's step-time ratio must be measured")
    rows = []
    for variant, q in quality.items():
        if variant == "control":
            continue
        records = {seed: load_metrics(os.path.join(root, f"seed{seed}", variant)) for seed in q["seeds"]}
        routing = {seed: routing_history(r) for seed, r in records.items()}
        cosines = {seed: measured_cos(r) for seed, r in records.items()}
        ratio, spread = (1.0, 0.0) if variant == "vanilla" else step_ratio(*benches[variant])
        rows.append(dict(variant=variant, mean=q["final_mean"], sd=q["final_sd"], per_seed=q["per_seed"],
                         final_step=q["final_step"], step_ratio=ratio, step_spread=spread,
                         backwards_per_step=q["backwards_per_step"],
                         routing=describe_routing(routing), routing_per_seed=routing, measured_cos=describe_cos(cosines)))
    return rows


def window_of(variant, default_window):
    m = WINDOW.search(variant)
    return int(m.group(1)) if m else default_window


def clearly_faster(a, b):
    """a's step is shorter than b's by more than both benches' repetition spreads."""
    return a["step_ratio"] + a["step_spread"] < b["step_ratio"] - b["step_spread"]


def verdicts(rows, tolerance_sd, goal_ratio, default_window):
    """The fastest variant at vanilla's quality (and those within the benches' spread of it), the goal,
    and auto against the fixed fractions of its window."""
    vanilla = next(r for r in rows if r["variant"] == "vanilla")
    floor = vanilla["mean"] - tolerance_sd * vanilla["sd"]
    equal = [r for r in rows if r["mean"] >= floor]
    best = min(equal, key=lambda r: r["step_ratio"])
    out = dict(floor=floor, fastest_equal=best["variant"], fastest_equal_ratio=best["step_ratio"],
               fastest_tied=[r["variant"] for r in equal if r is not best and not clearly_faster(best, r)],
               goal_ratio=goal_ratio, goal_met=best["step_ratio"] <= goal_ratio, auto={})
    fixed = [r for r in rows if r["variant"] not in ("vanilla", "endpoints") and "auto" not in r["variant"]]
    for auto in (r for r in rows if "auto" in r["variant"]):
        w = window_of(auto["variant"], default_window)
        same_w = [r for r in fixed if window_of(r["variant"], default_window) == w and r["mean"] >= floor]
        out["auto"][auto["variant"]] = dict(
            window=w, equal_quality=auto["mean"] >= floor,
            beats_every_fixed=auto["mean"] >= floor and all(clearly_faster(auto, r) for r in same_w),
            slower_than=[r["variant"] for r in same_w if clearly_faster(r, auto)],
            fixed_compared=[r["variant"] for r in same_w])
    return out


def markdown(rows, verdict, metric, tolerance_sd):
    step = rows[0]["final_step"]
    lines = [f"| configuration | {metric} at step {step}, mean ± sd (per seed) | whole step / vanilla's | "
             "backwards / step | routing auto chose (step: positions) | cos the monitor measured |", "|---|---|---|---|---|---|"]
    for r in rows:
        per_seed = " / ".join(f"{v:.3f}" for v in r["per_seed"].values())
        ratio = f"{r['step_ratio']:.2f}" + (f" ± {r['step_spread']:.2f}" if r["step_spread"] else "")
        lines.append(f"| {r['variant']} | {r['mean']:.3f} ± {r['sd']:.3f} ({per_seed}) | {ratio} | "
                     f"{r['backwards_per_step']:g} | {r['routing']} | {r['measured_cos']} |")
    v = verdict
    lines += ["", f"- Fastest within {tolerance_sd:g} seed-sd of vanilla ({metric} >= {v['floor']:.3f}): "
              f"**{v['fastest_equal']}**, {v['fastest_equal_ratio']:.2f} of vanilla's step time "
              f"({1 / v['fastest_equal_ratio']:.2f}x). Goal (ratio <= {v['goal_ratio']:.2f}): "
              f"{'met' if v['goal_met'] else 'NOT met'}."
              + (f" Within the benches' spread of it: {', '.join(v['fastest_tied'])}." if v["fastest_tied"] else "")]
    for name, a in v["auto"].items():
        lines.append(f"- {name}" + ("" if not a["equal_quality"] else f" (W {a['window']})") + ": " + auto_verdict(a))
    return "\n".join(lines)


def auto_verdict(a):
    w, compared = a["window"], ", ".join(a["fixed_compared"])
    if not a["equal_quality"]:
        return "below vanilla's quality floor; not compared."
    if not a["fixed_compared"]:
        return f"no fixed fraction of W {w} at equal quality to compare."
    if a["beats_every_fixed"]:
        return f"faster than every fixed fraction of W {w} at equal quality, beyond the benches' spread ({compared})."
    if a["slower_than"]:
        return f"NOT faster: slower than {', '.join(a['slower_than'])} beyond the benches' spread."
    return f"NOT faster than every fixed fraction of W {w} at equal quality: within the benches' spread of {compared}."


def plot_pareto(path, panels, metric, title=None):
    """panels: [(family, rows)] -> metric against step-time ratio, one point per configuration, sd bars."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, (family, rows) in zip(axes[0], panels):
        for i, r in enumerate(rows):
            ax.errorbar([r["step_ratio"]], [r["mean"]], yerr=[r["sd"]], xerr=[r["step_spread"]], fmt="o",
                        color=f"C{i % 10}", capsize=3,
                        label=r["variant"])
        ax.set_xlabel("whole-step time / vanilla's (lower is faster)")
        ax.set_ylabel(f"{metric} at the last step (mean ± sd over seeds)")
        ax.set_title(family)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return save_figure(fig, path, title)


def tradeoff(root, benches, metric="digit_heldout", tolerance_sd=1.0, goal_ratio=0.6, default_window=4):
    rows = collect(root, benches, metric)
    verdict = verdicts(rows, tolerance_sd, goal_ratio, default_window)
    return rows, verdict, markdown(rows, verdict, metric, tolerance_sd)


def main(argv=None):
    p = CommandParser(prog="python -m jagg_patch.tools.tradeoff", description=__doc__.splitlines()[0])
    p.add_argument("root", help="One family's quality folder (report/report.json, seed<S>/<variant>/).")
    p.add_argument("--bench", action="append", default=[], metavar="VARIANT=BENCH_JSON:MODE")
    p.add_argument("--metric", default="digit_heldout")
    p.add_argument("--tolerance_sd", type=float, default=1.0)
    p.add_argument("--goal_ratio", type=float, default=0.6,
                   help="The whole-step ratio the fastest equal-quality variant should reach (0.6: 40%% less time).")
    p.add_argument("--window", type=int, default=4, help="The window of variants whose name carries no _w<N>.")
    p.add_argument("--out", default=None)
    p.add_argument("--title", default=None)
    return exit_on_config_error(run_command)(p.parse_args(argv))


def run_command(args):
    benches = {v: (path, mode) for v, path, mode in map(parse_bench, args.bench)}
    rows, verdict, text = tradeoff(args.root, benches, args.metric, args.tolerance_sd, args.goal_ratio, args.window)
    print(text)
    if args.out:
        with output_errors(args.out):
            write_text(os.path.join(args.out, "tradeoff.md"), text + "\n")
            write_text(os.path.join(args.out, "tradeoff.json"), json_text(dict(rows=rows, verdict=verdict)))
            plot_pareto(os.path.join(args.out, "pareto.png"), [(args.title or os.path.basename(args.root), rows)],
                        args.metric)
    return rows, verdict


if __name__ == "__main__":
    main()
