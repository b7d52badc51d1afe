"""Quality over seeds: training-reward and held-out curves (mean and spread), and the final table.

    python -m jagg_patch.tools.quality_report ROOT [--metric digit_heldout] [--ma_window 5] [--out DIR]

ROOT holds one folder per seed, seed<S>/, each with one trainer --output_dir per variant
(seed<S>/<variant>/metrics.jsonl) and eval/comparison.json written by `python -m
dancegrpo.evaluate` for checkpoints labelled <variant>@<step> (and base@0, the model before
training, which starts every variant's held-out curve). benchmarks/digits.sh lays it out so.

Per variant, over the seeds: the moving-average training reward per step and the evaluation
metric per evaluated step, each as mean with min..max band (curves.png); the table gives the
final metric per seed, mean ± sd (sample sd over seeds), the change from base, the final MA
training reward and the median update-phase time and backwards per step (report.md / .json).
A variant missing from some seed, or a seed lacking the final evaluation of a variant, is an
error naming the folder: the mean would silently average different seed sets.
"""
import argparse
import os
import re
import statistics

from dancegrpo.errors import exit_on_config_error
from dancegrpo.utils.atomic import write_text
from dancegrpo.utils.command_line import CommandParser
from dancegrpo.utils.plots import plot_mean_spread

from ..spread import spread
from .compare import summarize
from .reports import json_text, output_errors
from .run_records import CompareError, load_metrics, read_json

LABEL = re.compile(r"^(?P<variant>.+)@(?P<step>\d+)$")


def seed_folders(root):
    """{seed: folder} of ROOT/seed<S>/, in seed order."""
    if not os.path.isdir(root):
        raise CompareError(f"{root!r} does not exist")
    found = {int(m.group(1)): os.path.join(root, name) for name in os.listdir(root)
             if (m := re.fullmatch(r"seed(\d+)", name)) and os.path.isdir(os.path.join(root, name))}
    if not found:
        raise CompareError(f"{root!r} holds no seed<S>/ folders (run benchmarks/digits.sh, or lay out "
                           "ROOT/seed<S>/<variant>/ and ROOT/seed<S>/eval/)")
    return dict(sorted(found.items()))


def eval_points(folder):
    """{variant: {step: {metric: mean}}} from folder/eval/comparison.json; base@0 is kept as variant 'base'."""
    path = os.path.join(folder, "eval", "comparison.json")
    if not os.path.isfile(path):
        raise CompareError(f"{path!r} not found: evaluate the checkpoints first (python -m dancegrpo.evaluate "
                           "... --checkpoint VARIANT@STEP=PATH --output_dir SEED_FOLDER/eval)")
    points = {}
    for summary in read_json(path, "evaluate the checkpoints again (python -m dancegrpo.evaluate ...)"):
        m = LABEL.match(summary["label"])
        if not m:
            continue
        metrics = {k: (float("nan") if v["mean"] is None else v["mean"]) for k, v in summary["metrics"].items()}
        points.setdefault(m["variant"], {})[int(m["step"])] = metrics
    return points


def _band(per_seed_series):
    """[[y per step] per seed] (same length) -> {"mean", "low", "high"} lists."""
    stats = [spread(list(column)) for column in zip(*per_seed_series)]
    return {"mean": [s["mean"] for s in stats], "low": [s["min"] for s in stats], "high": [s["max"] for s in stats]}


def collect(root, metric, ma_window=5, variants=None):
    """All numbers of the report: per variant, its seeds' training summaries and evaluated points."""
    seeds = seed_folders(root)
    evals = {seed: eval_points(folder) for seed, folder in seeds.items()}
    if variants is None:
        variants = [v for v in sorted(os.listdir(next(iter(seeds.values()))))
                    if os.path.isfile(os.path.join(next(iter(seeds.values())), v, "metrics.jsonl"))]
        variants.sort(key=lambda v: (v != "vanilla", v == "control"))  # reference first, control last
    out = {}
    for variant in variants:
        runs = {}
        for seed, folder in seeds.items():
            records = load_metrics(os.path.join(folder, variant))
            row, rewards, ma = summarize(variant, records, ma_window)
            points = evals[seed].get(variant, {})
            if not points:
                raise CompareError(f"{folder}/eval/comparison.json has no {variant}@<step> row")
            if metric not in next(iter(points.values())):
                raise CompareError(f"metric {metric!r} was not evaluated; have {sorted(next(iter(points.values())))}")
            base = evals[seed].get("base", {}).get(0)
            curve = dict(sorted({**({0: base} if base else {}), **points}.items()))
            runs[seed] = dict(row=row, steps=[r["step"] for r in records], ma=ma,
                              eval_steps=list(curve), eval=[curve[s][metric] for s in curve],
                              base=base[metric] if base else float("nan"))
        out[variant] = runs
    return out


def summarize_variants(data):
    rows = []
    for variant, runs in data.items():
        finals = {seed: r["eval"][-1] for seed, r in runs.items()}
        last_steps = {r["eval_steps"][-1] for r in runs.values()}
        if len(last_steps) > 1:
            raise CompareError(f"{variant}: the seeds' last evaluated steps differ ({sorted(last_steps)})")
        final, base = spread(list(finals.values())), spread([r["base"] for r in runs.values()])
        rows.append(dict(variant=variant, seeds=list(runs), final_step=last_steps.pop(), per_seed=finals,
                         final_mean=final["mean"], final_sd=final["sd"], change_from_base=final["mean"] - base["mean"],
                         final_ma_reward=spread([r["ma"][-1] for r in runs.values()]),
                         update_time_s=statistics.median(r["row"]["update_time_s"] for r in runs.values()),
                         backwards_per_step=statistics.median(r["row"]["backwards_per_step"] for r in runs.values())))
    return rows


def curves(data):
    """The two panels of curves.png: MA training reward per step, metric per evaluated step."""
    train, held = {}, {}
    for variant, runs in data.items():
        n = min(len(r["ma"]) for r in runs.values())
        train[variant] = dict(steps=next(iter(runs.values()))["steps"][:n], **_band([r["ma"][:n] for r in runs.values()]))
        held[variant] = dict(steps=next(iter(runs.values()))["eval_steps"], **_band([r["eval"] for r in runs.values()]))
    return train, held


def markdown(rows, metric, ma_window):
    lines = [f"| run | {metric} at step {rows[0]['final_step']}, per seed | mean ± sd | change from base | "
             f"final MA({ma_window}) training reward, mean ± sd | update s (median) | backwards / step |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        per_seed = " / ".join(f"{v:.3f}" for v in r["per_seed"].values())
        ma = r["final_ma_reward"]
        lines.append(f"| {r['variant']} | {per_seed} | {r['final_mean']:.3f} ± {r['final_sd']:.3f} | "
                     f"{r['change_from_base']:+.3f} | {ma['mean']:.3f} ± {ma['sd']:.3f} | {r['update_time_s']:.3f} | "
                     f"{r['backwards_per_step']:g} |")
    lines += ["", f"Seeds: {', '.join(map(str, rows[0]['seeds']))}; sd is the sample standard deviation over "
              "seeds; base = the model before training, evaluated the same way."]
    return "\n".join(lines)


def report(root, metric="digit_heldout", ma_window=5, out=None, title=None, variants=None):
    data = collect(root, metric, ma_window, variants)
    rows = summarize_variants(data)
    text = markdown(rows, metric, ma_window)
    if out:
        train, held = curves(data)
        with output_errors(out):
            plot_mean_spread(os.path.join(out, "curves.png"),
                             [(f"training reward, MA {ma_window}: mean, min..max over seeds", "reward", train),
                              (f"{metric} of fixed-noise samples: mean, min..max over seeds", metric, held)], title)
            write_text(os.path.join(out, "report.md"), text + "\n")
            write_text(os.path.join(out, "report.json"),
                       json_text({"rows": rows, "train_curves": train, "eval_curves": held}))
    return rows, text


def main(argv=None):
    p = CommandParser(prog="python -m jagg_patch.tools.quality_report", description=__doc__.split("\n\n")[0],
                      formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("root", metavar="ROOT", help="Folder of seed<S>/ folders.")
    p.add_argument("--metric", default="digit_heldout", help="Evaluated metric of the table and the right panel.")
    p.add_argument("--ma_window", type=int, default=5, help="Moving average of the training reward (steps).")
    p.add_argument("--out", default=None, help="Write curves.png, report.md and report.json here.")
    p.add_argument("--title", default=None)
    p.add_argument("--variants", default=None,
                   help="Comma list: which variants, in this order (default: all, vanilla first, control last).")
    return exit_on_config_error(run_command)(p.parse_args(argv))


def run_command(args):
    variants = [v.strip() for v in args.variants.split(",") if v.strip()] if args.variants else None
    rows, text = report(args.root, args.metric, args.ma_window, args.out, args.title, variants)
    print(text, flush=True)
    return rows


if __name__ == "__main__":
    main()
