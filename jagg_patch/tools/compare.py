"""Compare training runs side by side: the "diff against vanilla DanceGRPO".

    python -m jagg_patch.tools.compare RUN_DIR [RUN_DIR ...] [--labels vanilla,jagg,...] [--out DIR]
                                 [--ma_window 10] [--skip_first 1] [--no_plots]

Each RUN_DIR is one of (the first run is the reference):
- this trainer's --output_dir, holding metrics.jsonl (one JSON line per step);
- the --output_dir of an upstream DanceGRPO run through `python -m jagg_patch.upstream`, holding
  jagg_metrics.jsonl (its last run, by run_id, when several were written there): times, counts and
  the gathered reward; run with `--jagg_mode exact` it is upstream's own step, the vanilla side;
- a plain upstream run's reward file (./reward.txt, or ./hps_reward.txt before bbf5278; line k is
  step k's mean reward), or a folder holding one: its reward curve, no times or counts; a HunyuanVideo
  run's ./vq_reward.txt and ./mq_reward.txt are read together (the reward: VQ; final MQ / VQ moving
  averages in their own fields, as for an adapter's HunyuanVideo run, which logs both).
Printed, one row per run:

- steps: distinct steps in metrics.jsonl (a step logged twice, e.g. after a resume, counts once:
  the last record wins);
- median step / rollout / update time (s), over the steps after the first --skip_first ones
  (warm-up; all steps are used when a run has no more);
- transformer forwards with grad, without grad, and backwards per step (median);
- final and best moving-average reward: trailing mean over --ma_window steps (min(window, steps)
  when the run is shorter); "best" is the maximum over the positions with a full window;
- the PPO statistics GRPO runs are compared by (dancegrpo.algo.ratio_stats, logged by this trainer
  and by jagg_patch.upstream): clip_frac and approx_kl averaged over the steps, and the range of the
  ratio over every step (n/a for a run that logged none, e.g. a reward file);
- speedup vs the first run: 1 - t / t_first of the median step time and of the median update time
  (the paper's "gain": 279 s -> 228 s is 18.3%), and the ratio t_first / t.

With --out DIR: comparison.json (all numbers), comparison.csv (one row per run), comparison.md
(the table), rewards.csv (per-step reward and moving average of every run) and, unless
--no_plots, reward_curves.png (raw reward faint, moving average bold), step_times.png
(median rollout + update time per run, stacked bars) and, when a run was monitored
(--jagg_monitor_every), jagg_cos.png (cos(JAGG, exact) per group position over the steps).

Bad input (missing folder, no or empty metrics.jsonl, a malformed line before the last) prints
an error and exits with status 2. Printed as warnings, the numbers still shown: a torn last line
(a run killed mid-write; read as missing), NaN/inf in a run's reward, loss, grad norm or PPO ratio
statistics (the run is marked NON-FINITE and its reward is not ranked), runs of different lengths,
models, presets, rank counts or precisions, a run resumed with --allow_config_change (its
configuration changed at a step: the records' config_id), and fewer than MIN_TIMED_STEPS timed steps (too
few for a timing claim). comparison.json is strict JSON: a number a run could not give is null.
"""
import argparse
import csv
import glob
import io
import json
import math
import os
import statistics

from dancegrpo.utils.plots import moving_average

from dancegrpo.errors import exit_on_config_error
from dancegrpo.utils.atomic import write_text
from dancegrpo.utils.command_line import CommandParser

from .compare_plots import fidelity_curves, write_plots
from .reports import json_text, output_errors
from .run_records import CompareError, load_metrics, warn

COUNT_FIELDS = ("transformer_forwards_grad", "transformer_forwards_nograd", "transformer_backwards")
# A NaN in any of these means the run diverged (a NaN ratio: its log-probs were NaN).
FINITE_FIELDS = ("reward_mean", "loss", "grad_norm", "ratio_mean", "ratio_min", "ratio_max", "approx_kl")
MIN_TIMED_STEPS = 3


def _over(records, field, reduce=statistics.median):
    """reduce() of a field's numbers over the records; NaN where no record holds one."""
    values = [r[field] for r in records if isinstance(r.get(field), (int, float))]
    return reduce(values) if values else float("nan")


def _median(records, field):
    return _over(records, field)


def ratio_statistics(records):
    """The PPO statistics over the run (dancegrpo.algo.ratio_stats; NaN where a run logged none):
    clip_frac and approx_kl as the mean over steps, the ratio's range over every step."""
    return dict(clip_frac=_over(records, "clip_frac", statistics.fmean),
                approx_kl=_over(records, "approx_kl", statistics.fmean),
                ratio_min=_over(records, "ratio_min", min), ratio_max=_over(records, "ratio_max", max))


def nonfinite_steps(records):
    """{field: [steps]} where a reward, loss or grad norm was NaN/inf."""
    found = {}
    for r in records:
        for field in FINITE_FIELDS:
            if isinstance(r.get(field), (int, float)) and not math.isfinite(r[field]):
                found.setdefault(field, []).append(r["step"])
    return found


def summarize(label, records, ma_window=10, skip_first=1):
    """One run's row (a dict). Times are medians over the steps after the warm-up ones. A run
    with a NaN/inf reward, loss or grad norm gets nonfinite set and NaN rewards (never "best")."""
    bad = nonfinite_steps(records)
    rewards = [float(r["reward_mean"]) for r in records if "reward_mean" in r]
    timed = records[skip_first:] if len(records) > skip_first else records
    window = min(ma_window, len(rewards)) if rewards else 1
    ma = moving_average(rewards, window)
    full = ma[window - 1:]
    row = dict(label=label, steps=len(records), first_step=records[0]["step"], last_step=records[-1]["step"],
               timed_steps=len(timed), ma_window=window,
               step_time_s=_median(timed, "step_time_s"), rollout_time_s=_median(timed, "rollout_time_s"),
               update_time_s=_median(timed, "update_time_s"),
               activation_peak_mb=_median(records, "activation_peak_mb"),
               **{f.replace("transformer_", "") + "_per_step": _median(records, f) for f in COUNT_FIELDS},
               **ratio_statistics(records),
               first_reward=rewards[0] if rewards else float("nan"),
               final_ma_reward=ma[-1] if ma else float("nan"),
               best_ma_reward=max(full) if full else float("nan"),
               **video_rewards(records, window),
               nonfinite="; ".join(f"{f} at steps {s[:5]}" for f, s in bad.items()))
    if bad:
        row.update(final_ma_reward=float("nan"), best_ma_reward=float("nan"))
    return row, rewards, ma


def video_rewards(records, window):
    """A HunyuanVideo run's final moving averages of each VideoAlign reward (none for other runs)."""
    found = {}
    for name in ("vq", "mq"):
        values = [float(r[f"{name}_reward_mean"]) for r in records if f"{name}_reward_mean" in r]
        if values:
            found[f"final_ma_{name}_reward"] = moving_average(values, min(window, len(values)))[-1]
    return found


def _gain(t, ref):
    return 1.0 - t / ref if ref and ref > 0 and not math.isnan(t) else float("nan")


def _ratio(t, ref):
    return ref / t if t and t > 0 and not math.isnan(ref) else float("nan")


def run_setup(run_dir, records):
    """What a run was trained as, where it says: the model family (the adapter's records; this trainer's
    checkpoints' run_config.json), the preset and the rank count; None where nothing records it."""
    config = {}
    if os.path.isdir(run_dir):
        configs = sorted(glob.glob(os.path.join(run_dir, "checkpoint-*", "run_config.json")))
        if configs:
            try:
                with open(configs[-1]) as f:
                    config = json.load(f)
            except (OSError, ValueError):
                config = {}
    last = records[-1]
    return dict(family=last.get("family", config.get("family")), preset=config.get("preset"),
                world_size=last.get("world_size", config.get("world_size")),
                precision=last.get("precision"))


SETUP_WORDS = {"family": "models", "preset": "presets", "world_size": "rank counts", "precision": "precisions"}


def warn_mixed_configurations(label, records):
    """A run resumed with --allow_config_change holds steps of several configurations (the trainer's
    records carry config_id, a digest of the flags that change a run): its curve and medians mix them."""
    starts, last = [], None
    for r in records:
        cid = r.get("config_id")
        if cid is not None and cid != last:
            starts.append(r["step"])
            last = cid
    if len(starts) > 1:
        warn(f"run {label!r} changed its configuration at step(s) {starts[1:]} (resumed with --allow_config_change): "
             "its curve and medians mix them; each checkpoint's run_config.json says which flags it ran with")


def warn_across_setups(rows):
    """A speedup or reward gap between runs of different models, presets or rank counts measures that
    difference too: said, naming each run's."""
    for field, words in SETUP_WORDS.items():
        seen = {row["label"]: row[field] for row in rows if row.get(field) is not None}
        if len(set(seen.values())) > 1:
            warn(f"the runs are of different {words} ({', '.join(f'{k}: {v}' for k, v in seen.items())}): their "
                 "step times and rewards differ by that too; the speedups are against the first run")


def compare(run_dirs, labels=None, ma_window=10, skip_first=1):
    """Rows for every run, with speedups vs the first; and the per-run reward curves."""
    if not run_dirs:
        raise CompareError("give at least one run folder")
    labels = list(labels) if labels else [os.path.basename(os.path.normpath(d)) or d for d in run_dirs]
    if len(labels) != len(run_dirs):
        raise CompareError(f"{len(labels)} labels for {len(run_dirs)} run folders")
    rows, curves = [], {}
    for label, run_dir in zip(labels, run_dirs):
        if label in curves:
            raise CompareError(f"two runs are labelled {label!r}; give --labels")
        records = load_metrics(run_dir)
        row, rewards, ma = summarize(label, records, ma_window, skip_first)
        if row["nonfinite"]:
            warn(f"run {label!r} has non-finite values ({row['nonfinite']}): it diverged; its reward is not ranked")
        if not any("step_time_s" in r for r in records):
            warn(f"run {label!r} is a reward file: its reward curve only, no times or counts")
        elif row["timed_steps"] < MIN_TIMED_STEPS:
            warn(f"run {label!r} has {row['timed_steps']} timed step(s) after the warm-up: too few for a timing "
                 f"claim (want >= {MIN_TIMED_STEPS})")
        warn_mixed_configurations(label, records)
        row["run_dir"] = run_dir
        row.update(run_setup(run_dir, records))
        rows.append(row)
        curves[label] = dict(steps=[r["step"] for r in records if "reward_mean" in r], reward=rewards, ma=ma)
        fidelity = fidelity_curves(records)
        if fidelity:
            curves[label]["jagg_cos"] = fidelity
    warn_across_setups(rows)
    lengths = {row["label"]: row["steps"] for row in rows}
    if len(set(lengths.values())) > 1:
        warn(f"runs have different lengths ({lengths}); rewards are compared over different spans")
    ref = rows[0]
    for row in rows:
        row["step_speedup"] = _gain(row["step_time_s"], ref["step_time_s"])
        row["step_speedup_ratio"] = _ratio(row["step_time_s"], ref["step_time_s"])
        row["update_speedup"] = _gain(row["update_time_s"], ref["update_time_s"])
        row["update_speedup_ratio"] = _ratio(row["update_time_s"], ref["update_time_s"])
    return rows, curves


def _fmt(x, spec):
    return "n/a" if isinstance(x, float) and math.isnan(x) else format(x, spec)


def _count(x):
    return "n/a" if isinstance(x, float) and math.isnan(x) else f"{x:g}"


COLUMNS = ["run", "steps", "step s", "rollout s", "update s", "fwd grad/step", "fwd no-grad/step", "bwd/step",
           "activation peak MB", "final MA reward", "best MA reward", "clip frac", "approx KL", "ratio range",
           "step speedup", "update speedup"]


def table_cells(row):
    return [row["label"] + (" (NON-FINITE)" if row.get("nonfinite") else ""), str(row["steps"]), _fmt(row["step_time_s"], ".3f"), _fmt(row["rollout_time_s"], ".3f"),
            _fmt(row["update_time_s"], ".3f"), _count(row["forwards_grad_per_step"]),
            _count(row["forwards_nograd_per_step"]), _count(row["backwards_per_step"]),
            _fmt(row["activation_peak_mb"], ".1f"), _fmt(row["final_ma_reward"], ".4f"),
            _fmt(row["best_ma_reward"], ".4f"), _fmt(row["clip_frac"], ".3f"), _fmt(row["approx_kl"], ".2e"),
            "n/a" if math.isnan(row["ratio_min"]) else f"[{row['ratio_min']:.4f}, {row['ratio_max']:.4f}]",
            _fmt(100 * row["step_speedup"], "+.1f") + "% (" + _fmt(row["step_speedup_ratio"], ".2f") + "x)",
            _fmt(100 * row["update_speedup"], "+.1f") + "% (" + _fmt(row["update_speedup_ratio"], ".2f") + "x)"]


def markdown_table(rows):
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(table_cells(r)) + " |" for r in rows]
    ma = rows[0]["ma_window"] if rows else 0
    lines.append("")
    lines.append(f"Times: medians over the steps after the warm-up; speedup = 1 - t / t({rows[0]['label']}) "
                 f"(ratio in brackets); MA = trailing mean over {ma} steps. clip frac (|ratio - 1| > clip range) "
                 "and approx KL (0.5 mean (logp - logp_old)^2): means over the steps; ratio range: over every "
                 "trained transition of every step.")
    return "\n".join(lines)


def write_outputs(out_dir, rows, curves, plots=True):
    write_text(os.path.join(out_dir, "comparison.json"), json_text({"runs": rows, "curves": curves}))
    write_text(os.path.join(out_dir, "comparison.csv"), _csv_text(list(rows[0]), [list(r.values()) for r in rows]))
    write_text(os.path.join(out_dir, "comparison.md"), markdown_table(rows) + "\n")
    write_text(os.path.join(out_dir, "rewards.csv"), _csv_text(
        ["run", "step", "reward_mean", "reward_ma"],
        [[label, s, r, m] for label, c in curves.items() for s, r, m in zip(c["steps"], c["reward"], c["ma"])]))
    written = []
    if plots:
        written = write_plots(out_dir, rows, curves)
    return written


def _csv_text(header, rows):
    buffer = io.StringIO(newline="")
    writer = csv.writer(buffer)
    writer.writerow(header)
    writer.writerows(rows)
    return buffer.getvalue()


def build_parser():
    p = CommandParser(prog="python -m jagg_patch.tools.compare", description=__doc__.split("\n\n")[0],
                      formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="Trainer output folders; the first is the reference.")
    p.add_argument("--labels", default=None, help="Comma list of names, one per run (default: folder names).")
    p.add_argument("--out", default=None, help="Write comparison.{json,csv,md}, rewards.csv and the PNG plots here.")
    p.add_argument("--ma_window", type=int, default=10, help="Moving-average window in steps (default 10).")
    p.add_argument("--skip_first", type=int, default=1,
                   help="Warm-up steps left out of the time medians (default 1).")
    p.add_argument("--no_plots", action="store_true", help="Do not write PNG plots.")
    return p


def main(argv=None):
    return exit_on_config_error(run_command)(build_parser().parse_args(argv))


def run_command(args):
    if args.ma_window < 1 or args.skip_first < 0:
        raise CompareError("--ma_window must be >= 1 and --skip_first >= 0")
    labels = [s.strip() for s in args.labels.split(",")] if args.labels else None
    rows, curves = compare(args.run_dirs, labels, args.ma_window, args.skip_first)
    print(markdown_table(rows), flush=True)
    if args.out:
        with output_errors(args.out):
            for path in write_outputs(args.out, rows, curves, plots=not args.no_plots):
                print(f"wrote {path}")
        print(f"wrote {os.path.join(args.out, 'comparison.{json,csv,md}')} and rewards.csv")
    return rows


if __name__ == "__main__":
    main()
