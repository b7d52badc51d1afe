"""Gradient fidelity averaged over several rollouts: the paper's "cosine 0.74-0.85 in groups 0-2".

    python -m jagg_patch.tools.fidelity dancegrpo.train_grpo_flux --preset small --output_dir runs/fid \\
        --jagg_window 4 [--jagg_grouping trained|window] [--jagg_alpha timestep|index] [--fid_rollouts 3] \\
        [--diag_samples 32] [--diag_warmup_steps 0] [--fid_out DIR]

For each of --fid_rollouts rollouts (the generators of training steps 1, 2, ...; prompts from the
loader in order), jagg_patch.tools.diagnostics measures, per group in denoising order (every group
planned as JAGG; with --jagg_grouping window, per trajectory window), the group gradient summed
over --diag_samples samples four ways: exact per-step, JAGG with the timestep alpha, JAGG with the
index alpha and the endpoints ablation. This module averages the per-rollout cosines (and relative
errors) over the rollouts and prints one row per group: mean, std, min and max of cos(JAGG, exact)
for both alpha rules and of cos(endpoints, exact). With --fid_out: fidelity.json (per rollout and
averaged), fidelity.csv and fidelity.md. Window 2 reproduces the exact gradient (cosine 1).
"""
import json
import os
import statistics
import sys

if __name__ == "__main__":   # --help and flag errors, before torch loads
    from jagg_patch.tools.tool_args import add_fidelity_args as _flags, answer_first
    answer_first("jagg_patch.tools.fidelity", __doc__, _flags)

from dancegrpo.errors import say  # noqa: E402

from ..cli import check_trajectory, trainer_cli  # noqa: E402
from ..spread import spread  # noqa: E402
from .diagnostics import measure_rollout, setup_diagnostics  # noqa: E402
from .tool_args import add_fidelity_args  # noqa: E402


def _stats(values):
    """The row's fields of one quantity over the rollouts: mean, sample sd (its `std` column), range."""
    found = spread(values)
    return dict(mean=found["mean"], std=found["sd"], min=found["min"], max=found["max"])


def aggregate(per_rollout):
    """per_rollout: a list (one per rollout) of diagnostics rows -> one averaged row per group."""
    rows = []
    for g in range(len(per_rollout[0])):
        members = [rows_r[g] for rows_r in per_rollout]
        row = dict(group=g, positions=members[0]["positions"], size=members[0]["size"],
                   rollouts=len(members), mean_t=statistics.fmean(m.get("mean_t", float("nan")) for m in members))
        for key in ("cos_jagg", "relerr_jagg", "cos_endpoints", "relerr_endpoints", "cos_jagg_index",
                    "relerr_jagg_index"):
            for stat, value in _stats([m[key] for m in members]).items():
                row[f"{key}_{stat}"] = value
        rows.append(row)
    return rows


def _cell(r, key):
    return f"{r[key + '_mean']:.4f} ± {r[key + '_std']:.4f} [{r[key + '_min']:.4f}, {r[key + '_max']:.4f}]"


def format_markdown(rows, window, family, rollouts, samples, grouping="trained"):
    row_name, members = ("window", "transitions") if grouping == "window" else ("group", "positions")
    lines = [f"## Gradient fidelity: {family}, window {window}, grouping {grouping}, {rollouts} rollout(s) x "
             f"{samples} samples",
             "",
             "cos = cosine(group gradient, exact group gradient); mean ± sample sd over rollouts [min, max]; "
             "relerr = |g - g_exact| / |g_exact| (mean). JAGG: timestep alpha (the paper); JAGG index: "
             "alpha j / (W-1) (the authors' code).",
             "",
             f"| {row_name} | {members} | mean t | cos JAGG | relerr JAGG | cos endpoints | "
             "relerr endpoints | cos JAGG index | relerr JAGG index |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        note = " (size 1: exact)" if r["size"] == 1 else ""
        lines.append(f"| {r['group']}{note} | {r['positions']} | {r['mean_t']:.3f} | {_cell(r, 'cos_jagg')} | "
                     f"{r['relerr_jagg_mean']:.4f} | {_cell(r, 'cos_endpoints')} | {r['relerr_endpoints_mean']:.4f} | "
                     f"{_cell(r, 'cos_jagg_index')} | {r['relerr_jagg_index_mean']:.4f} |")
    return "\n".join(lines)


def run_fidelity(module, args):
    ctx = setup_diagnostics(module, args)
    first = ctx.step + 1
    per_rollout = [measure_rollout(ctx, args, first + r) for r in range(args.fid_rollouts)]
    ctx.counter.remove()
    samples = min(args.diag_samples, args.train_batch_size * (args.num_generations if args.use_group else 1))
    return dict(family=ctx.family.name, window=args.jagg_window, grouping=args.jagg_grouping,
                rollouts=args.fid_rollouts, samples=samples,
                sampling_steps=args.sampling_steps, timestep_fraction=args.timestep_fraction,
                warmup_steps=args.diag_warmup_steps, num_params=ctx.num_params,
                groups=aggregate(per_rollout), per_rollout=per_rollout)


def write_outputs(out_dir, result, markdown):
    import csv
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "fidelity.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out_dir, "fidelity.md"), "w") as f:
        f.write(markdown + "\n")
    with open(os.path.join(out_dir, "fidelity.csv"), "w", newline="") as f:
        rows = [{**r, "positions": " ".join(map(str, r["positions"]))} for r in result["groups"]]
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    module, parser, rest = trainer_cli(argv, "jagg_patch.tools.fidelity", __doc__, add_fidelity_args)
    from dancegrpo.args import parse_args
    from dancegrpo.errors import exit_on_config_error
    args = parse_args(parser, rest)
    check_trajectory(args)
    if args.fid_rollouts < 1:
        say("error: --fid_rollouts must be >= 1")
        sys.exit(2)
    result = exit_on_config_error(run_fidelity)(module, args)
    markdown = format_markdown(result["groups"], result["window"], result["family"], result["rollouts"],
                               result["samples"], result["grouping"])
    print(markdown, flush=True)
    if args.fid_out:
        write_outputs(args.fid_out, result, markdown)
    return result


if __name__ == "__main__":
    main()
