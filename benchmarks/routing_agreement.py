"""How often --jagg_frac auto routes one model the same way, measured at 2, 4 and 8 samples.

    python benchmarks/routing_agreement.py --family flux --preset digits_large --out runs/agreement \\
        [--windows 4,8] [--min_cos 0.99,0.8] [--rollouts 6] [--samples 16] [--sizes 2,4,8]

The model is fixed (the preset's); each of --rollouts rollouts (the generators of training steps 1,
2, ...) gives --samples samples whose cosine cos(JAGG, exact) per group position the live monitor
measures one sample at a time (jagg_patch.monitor, the update's own passes). Every disjoint set of n
of a rollout's samples is one measurement auto could have made at --jagg_monitor_samples n, and is
routed two ways from scratch (a first measurement): by its mean (mean >= min_cos, the rule before the
confidence bound) and by auto's rule (jagg_patch.routing: the one-sided 95% bound clears min_cos).
Printed per (W, min_cos, n): the share of pairs of measurements that route every position alike, and
the mean number of positions routed. Writes agreement.json and agreement.md under --out.
"""
import itertools
import json
import math
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def per_sample_cosines(family, preset, window, rollouts, samples, cache_dir):
    """[(rollout, sample, {position: cos})] measured by the monitor on one-sample batches."""
    import importlib
    from dancegrpo import trainer
    from dancegrpo.args import parse_args
    from jagg_patch.monitor import Monitor
    from jagg_patch.update import batch_groups, group_backward
    module = importlib.import_module(f"dancegrpo.train_grpo_{family}")
    args = parse_args(module.build_parser(), ["--preset", preset, "--cache_dir", cache_dir, "--output_dir",
                                              os.path.join(cache_dir, "agreement_run")])
    ctx = trainer.setup(args, module.FAMILY(args))

    def every_group(one):
        for sub, cols, group in batch_groups(one, window, 1.0):
            yield group.index, sub, cols

    found = []
    for r in range(1, rollouts + 1):
        prepared = trainer.prepare_update(ctx, step=r)
        ctx.transformer.train()
        for s in range(min(samples, prepared.advantages.numel())):
            idx = torch.tensor([s])
            batch = trainer.make_update_batch(ctx, prepared.rollout, prepared.cond, prepared.advantages, idx,
                                              prepared.selection.steps[idx], prepared.normaliser, True)
            batch.step = 1
            monitor = Monitor(1, 1, "timestep", "split")
            monitor.due(batch)
            metrics, _ = monitor.measure(batch, every_group, group_backward)
            found.append((r, s, {int(k.split("/g")[1]): v for k, v in metrics.items() if k.startswith("jagg_cos/g")}))
    ctx.counter.remove()
    return found


def routed_by_mean(cosines, min_cos):
    return frozenset(p for p in cosines[0] if statistics.fmean(c[p] for c in cosines) >= min_cos)


def routed_by_bound(cosines, min_cos):
    from jagg_patch.routing import AutoRouting
    routing, n = AutoRouting(min_cos), len(cosines)
    metrics = {}
    for p in cosines[0]:
        values = [c[p] for c in cosines]
        metrics[f"jagg_cos/g{p}"] = statistics.fmean(values)
        metrics[f"jagg_cos_sd/g{p}"] = statistics.stdev(values) if n > 1 else 0.0
        metrics[f"jagg_cos_n/g{p}"] = n
    routing.update(metrics)
    return frozenset(routing.routed)


def agreement(decisions):
    pairs = list(itertools.combinations(decisions, 2))
    return sum(a == b for a, b in pairs) / len(pairs) if pairs else math.nan


def measurements(found, n):
    """Every disjoint run of n samples of a rollout, in sample order: the monitor's n first samples of
    n different steps of the same model."""
    by_rollout = {}
    for r, _, cos in found:
        by_rollout.setdefault(r, []).append(cos)
    return [cosines[i:i + n] for cosines in by_rollout.values() for i in range(0, len(cosines) - n + 1, n)
            if all(len(c) == len(cosines[0]) for c in cosines[i:i + n])]


def summarize(found, min_cos, sizes):
    rows = []
    for n in sizes:
        sets = measurements(found, n)
        mean_rule = [routed_by_mean(c, min_cos) for c in sets]
        bound_rule = [routed_by_bound(c, min_cos) for c in sets]
        rows.append(dict(n=n, measurements=len(sets), agree_mean=agreement(mean_rule),
                         agree_bound=agreement(bound_rule),
                         routed_mean=statistics.fmean(len(s) for s in mean_rule),
                         routed_bound=statistics.fmean(len(s) for s in bound_rule),
                         positions=len(found[0][2])))
    return rows


def main(argv=None):
    from dancegrpo.utils.command_line import CommandParser   # the repository root is on the path now
    p = CommandParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", choices=("flux", "qwenimage"), required=True)
    p.add_argument("--preset", default="digits_large")
    p.add_argument("--windows", default="4,8")
    p.add_argument("--min_cos", default="0.99,0.8")
    p.add_argument("--rollouts", type=int, default=6)
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--sizes", default="2,4,8")
    p.add_argument("--cache_dir", default="./cache_dir")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",")]
    if min(sizes) < 2 or max(sizes) > args.samples:
        sys.exit(f"error: --sizes must be >= 2 (a spread) and <= --samples ({args.samples})")
    os.makedirs(args.out, exist_ok=True)
    result = dict(family=args.family, preset=args.preset, rollouts=args.rollouts, samples=args.samples, tables=[])
    lines = [f"## Routing agreement: {args.family}, {args.preset}, {args.rollouts} rollouts x {args.samples} samples "
             f"(disjoint sets of n samples = measurements of one model)"]
    for window in (int(w) for w in args.windows.split(",")):
        start = time.time()
        found = per_sample_cosines(args.family, args.preset, window, args.rollouts, args.samples, args.cache_dir)
        seconds = time.time() - start
        cos = {p: [c[p] for _, _, c in found] for p in found[0][2]}
        lines += ["", f"W {window} ({seconds:.0f} s): per-sample cos per position, mean ± sd [min, max]: " + "; ".join(
            f"g{p} {statistics.fmean(v):.4f} ± {statistics.stdev(v):.4f} [{min(v):.4f}, {max(v):.4f}]"
            for p, v in cos.items())]
        for min_cos in (float(c) for c in args.min_cos.split(",")):
            rows = summarize(found, min_cos, sizes)
            result["tables"].append(dict(window=window, min_cos=min_cos, seconds=seconds, rows=rows,
                                         cosines=[dict(rollout=r, sample=s, cos=c) for r, s, c in found]))
            lines += ["", f"W {window}, min_cos {min_cos}:", "",
                      "| samples n | measurements | alike, mean >= min_cos | alike, 95% bound (auto) | positions "
                      "routed, mean rule | positions routed, bound |", "|---|---|---|---|---|---|"]
            lines += [f"| {r['n']} | {r['measurements']} | {r['agree_mean']:.2f} | {r['agree_bound']:.2f} | "
                      f"{r['routed_mean']:.2f} of {r['positions']} | {r['routed_bound']:.2f} of {r['positions']} |"
                      for r in rows]
    report = "\n".join(lines)
    print(report, flush=True)
    with open(os.path.join(args.out, "agreement.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out, "agreement.md"), "w") as f:
        f.write(report + "\n")
    return result


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main()
