"""Flow-GRPO's SD3 trainer (the stand-in of scripts/train_sd3.py, tests/flowgrpo_standin) side by side:
vanilla (the script as it is), deferred (`python -m jagg_patch.deferred`, the loop's own calls forwarded
without grad) and deferred + reuse (the rollout's outputs taken for on-policy rows), in ONE process, the
modes interleaved, medians over repetitions. Flow-GRPO's schedule: 10 sampling steps, the first 9
trained, CFG (the uncond half detached), two optimizer steps per epoch, so the rollout's outputs are
on-policy only for the first half of the epoch's samples. The stand-in's "small_sd3_bench" recipe: a
larger SD3Transformer2DModel in float32, beta 0 (the KL pass needs DDP's .module, and costs every mode
the same forwards).

    python benchmarks/flowgrpo_deferred.py [--reps 3] [--window 3] [--jagg_frac 1] [--out DIR]

Prints, per mode: the update phase's seconds (from the first update call to the last optimizer step),
its ratio to vanilla, the whole epoch's, and the rows forwarded with / without grad, reused, and the
backward calls; then the cost model's prediction (jagg_patch.tools.cost_flowgrpo, without KL).
"""
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))   # the stand-in's harness

CONFIG = os.path.join(REPO, "tests", "flowgrpo_standin", "config", "grpo.py") + ":small_sd3_bench"
MODES = ("vanilla", "deferred", "deferred_reuse")


@contextlib.contextmanager
def update_clock():
    """Times, per run: the first accelerator.accumulate entered (the first update call) and the end of the
    last real optimizer step; the run's start and end."""
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer
    marks = {}
    original_accumulate, original_prepare = Accelerator.accumulate, Accelerator.prepare

    @contextlib.contextmanager
    def accumulate(self, *models):
        marks.setdefault("update_start", time.perf_counter())
        with original_accumulate(self, *models):
            yield

    def prepare(self, *args, **kwargs):
        out = original_prepare(self, *args, **kwargs)
        for item in out if isinstance(out, tuple) else (out,):
            if isinstance(item, AcceleratedOptimizer):
                item.optimizer.register_step_post_hook(lambda *a: marks.__setitem__("update_end", time.perf_counter()))
        return out

    Accelerator.accumulate, Accelerator.prepare = accumulate, prepare
    marks["start"] = time.perf_counter()
    try:
        yield marks
    finally:
        marks["end"] = time.perf_counter()
        Accelerator.accumulate, Accelerator.prepare = original_accumulate, original_prepare


def run_mode(mode, workdir, window, jagg_frac, meter=None):
    from flowgrpo_harness import run_launcher, run_plain
    from helpers import read_jsonl
    save = os.path.join(workdir, mode)
    with update_clock() as marks, (meter or contextlib.nullcontext()):
        if mode == "vanilla":
            _, _, grad_calls = run_plain([], save, config=CONFIG)
        else:
            reuse = "on_policy" if mode == "deferred_reuse" else "off"
            run_launcher(["--jagg_window", window, "--jagg_frac", jagg_frac, "--jagg_reuse_rollout", reuse], [], save,
                         config=CONFIG)
    record = {"update_s": marks["update_end"] - marks["update_start"], "epoch_s": marks["end"] - marks["start"]}
    if mode == "vanilla":   # each update call: a doubled batch forwarded with grad, one backward through it
        rows = 2 * 2   # train.batch_size 2, [uncond; cond]
        record.update(rows_grad=grad_calls * rows, rows_nograd=0, rows_reused=0, backward_calls=grad_calls)
    else:
        lines = read_jsonl(os.path.join(save, "jagg_metrics.jsonl"))
        total = {k: sum(line[f"deferred_{k}"] for line in lines)
                 for k in ("forwards_grad", "forwards_nograd", "forwards_reused", "backward_calls")}
        record.update(rows_grad=total["forwards_grad"], rows_nograd=total["forwards_nograd"],
                      rows_reused=total["forwards_reused"], backward_calls=total["backward_calls"])
    return record


def paired(runs, mode, key):
    """mode / vanilla per repetition (run back to back, so a slow spell of the machine hits both), as
    'median (min-max)'."""
    ratios = [r[key] / v[key] for r, v in zip(runs[mode], runs["vanilla"])]
    return f"{statistics.median(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f})"


def main(argv=None):
    from dancegrpo.utils.command_line import CommandParser
    parser = CommandParser(prog="python benchmarks/flowgrpo_deferred.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--window", default="3")
    parser.add_argument("--jagg_frac", default="1")
    parser.add_argument("--out", default=None, help="where the runs' folders and flowgrpo_deferred.json go")
    args = parser.parse_args(argv)
    import warnings
    warnings.filterwarnings("ignore")
    import torch
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    out = args.out or tempfile.mkdtemp(prefix="flowgrpo_bench_")
    runs = {mode: [] for mode in MODES}
    run_mode("vanilla", os.path.join(out, "warmup"), args.window, args.jagg_frac)   # imports, first-call costs
    for rep in range(args.reps):
        for mode in MODES:
            runs[mode].append(run_mode(mode, os.path.join(out, f"rep{rep}"), args.window, args.jagg_frac))
    median = {mode: {k: statistics.median(r[k] for r in records) for k in records[0]} for mode, records in runs.items()}
    from dancegrpo.utils.activation_meter import ActivationMeter
    for mode in MODES:
        with ActivationMeter() as meter:
            run_mode(mode, os.path.join(out, "memory"), args.window, args.jagg_frac, meter)
        median[mode]["activation_peak_mb"] = meter.peak_mb
    base = median["vanilla"]
    print(f"Flow-GRPO SD3 stand-in (small_sd3_bench: S 10, 9 trained, CFG, two optimizer steps per epoch), "
          f"W {args.window}, jagg_frac {args.jagg_frac}, {args.reps} repetitions, medians, one process, "
          f"{torch.get_num_threads()} thread(s)")
    print("| mode | update s | update / vanilla | epoch s | epoch / vanilla | rows with grad | rows without grad | "
          "rows reused | backward calls | activation peak MB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for mode, m in median.items():
        print(f"| {mode} | {m['update_s']:.2f} | {paired(runs, mode, 'update_s')} | {m['epoch_s']:.2f} | "
              f"{paired(runs, mode, 'epoch_s')} | {m['rows_grad']:g} | {m['rows_nograd']:g} | "
              f"{m['rows_reused']:g} | {m['backward_calls']:g} | {m['activation_peak_mb']:.1f} |")
    print("(a ratio: the median over the repetitions of each one's mode / vanilla, the modes of a repetition "
          "run back to back; in parentheses the smallest and largest)")
    within = all(m["activation_peak_mb"] <= 1.05 * base["activation_peak_mb"] for m in median.values())
    print(f"activation peak within 1.05 x vanilla's in every mode: {'yes' if within else 'NO'}")
    from jagg_patch.tools.cost_flowgrpo import flowgrpo_table
    print()
    print("Predicted (jagg_patch.tools.cost_flowgrpo, no KL):")
    print(flowgrpo_table(windows=((int(args.window), float(args.jagg_frac)),), kl=False))
    with open(os.path.join(out, "flowgrpo_deferred.json"), "w") as f:
        json.dump({"runs": runs, "median": median, "window": args.window, "jagg_frac": args.jagg_frac}, f, indent=1)
    print(f"\nruns and flowgrpo_deferred.json in {out}")


if __name__ == "__main__":
    main()
