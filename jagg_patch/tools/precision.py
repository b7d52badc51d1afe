"""What the compute precision does to the update: the on-policy ratio and the PPO clip at the first
update of a step, and each group gradient's error against float64.

    python -m jagg_patch.tools.precision dancegrpo.train_grpo_flux --preset digits_large --output_dir runs/p \\
        --mixed_precision bf16 [--jagg_window 4 --jagg_frac 1 ...] [--prec_parts ratio,gradient,layers] \\
        [--prec_update_precision no] [--prec_samples 32] [--prec_json F] [--prec_md F]

One rollout (the generators of training step 1), in the run's precision (--mixed_precision).

ratio: every sample's update by vanilla, by JAGG with every middle member forwarded (reuse off) and
by JAGG with the rollout's outputs (reuse on_policy), each before any optimizer step (none is taken:
on-policy), with every (sample, transition) ratio recorded (dancegrpo.algo.ratio_stats): per
transition k, mean and max |r - 1| and the fraction outside --clip_range; and which (sample,
transition) pairs each JAGG form clips against vanilla's. --prec_update_precision P recomputes the
update's forwards in P (no: float32) while the rollout stays in the run's: a recompute whose rounding
is not the rollout's, as another kernel's (another batch shape) can be on a GPU.

layers: one forward of the first samples at the middle transition in the run's precision against
float64, module by module (where a precision's error enters the velocity).

gradient: per group position (the trained grouping, every group through JAGG), the group gradient
summed over --prec_samples samples: exact and JAGG in the run's precision, in float32, and JAGG in
float64 (a float64 copy of the model), each against the exact float64 one (cos, relative error). The
PPO clip is opened for this part (--clip_range 1e9): what is compared is the arithmetic of the
gradient, not which transitions one precision happens to clip.
"""
import argparse
import copy
import dataclasses
import sys

import torch

from .reports import print_and_write
from ..cli import check_trajectory, fail, jagg_config, trainer_cli
from ..similarity import gradient_similarity
from ..update import make_policy_update
from .diagnostics import accumulate_group, measured_groups

PARTS = ("ratio", "gradient", "layers")
# (precision, mode) of each group gradient the gradient part compares with the exact float64 one
GRADIENTS = (("run", "exact"), ("run", "jagg"), ("float32", "exact"), ("float32", "jagg"), ("float64", "jagg"))
LAYER_SAMPLES = 8
OPEN_CLIP = 1e9


def _ratio_rows(kept, clip_range, num_transitions):
    """Per transition k: (count, mean |r-1|, max |r-1|, clipped fraction); and the clipped pairs."""
    pairs = {}
    for samples, transitions, ratios in kept:
        for s, k, r in zip(samples.tolist(), transitions.tolist(), ratios.double().tolist()):
            pairs[(s, k)] = r
    rows = []
    for k in range(num_transitions):
        dev = [abs(r - 1) for (_, kk), r in pairs.items() if kk == k]
        if dev:
            rows.append(dict(transition=k, count=len(dev), mean_abs_dev=sum(dev) / len(dev), max_abs_dev=max(dev),
                             clip_frac=sum(d > clip_range for d in dev) / len(dev)))
    clipped = {pair for pair, r in pairs.items() if abs(r - 1) > clip_range}
    return rows, clipped, len(pairs)


def ratio_part(ctx, args, prepared, config, update_precision):
    """The on-policy ratios of vanilla and the two JAGG forms on one rollout (see the module doc)."""
    from dancegrpo import trainer
    from dancegrpo.algo.grpo import policy_update as vanilla_update
    from dancegrpo.algo.ratio_stats import RatioMeter
    rollout, n = prepared.rollout, prepared.advantages.numel()
    updates = {"vanilla": vanilla_update, "jagg": make_policy_update(config.replace(reuse="off")),
               "jagg_reuse": make_policy_update(config.replace(reuse="on_policy"))}
    run_precision, result = args.mixed_precision, {}
    ctx.args.mixed_precision = update_precision
    try:
        for name, update in updates.items():
            ctx.ratio_meter = RatioMeter(keep=True)
            ctx.transformer.zero_grad(set_to_none=True)
            trainer.accumulate_policy_gradient(ctx, rollout, prepared.cond, prepared.advantages, torch.arange(n),
                                               prepared.selection.steps, prepared.normaliser, update, on_policy=True)
            rows, clipped, pairs = _ratio_rows(ctx.ratio_meter.kept, args.clip_range, rollout.log_probs.shape[1] - 1)
            result[name] = dict(per_transition=rows, pairs=pairs, clipped=clipped,
                                summary=ctx.ratio_meter.summary(ctx.device))
    finally:
        ctx.args.mixed_precision = run_precision
        ctx.transformer.zero_grad(set_to_none=True)
        ctx.ratio_meter = RatioMeter()   # the parts after this one keep no ratios
    reference = result["vanilla"]["clipped"]
    for entry in result.values():
        clipped = entry.pop("clipped")
        entry.update(clipped_pairs=len(clipped), clipped_with_vanilla=len(clipped & reference),
                     clipped_not_vanilla=len(clipped - reference), vanilla_clipped_not_this=len(reference - clipped))
    return result


def _float64_context(ctx, args):
    """A float64 copy of the model behind the trainer's own closures: no autocast, the clip open."""
    model = copy.deepcopy(ctx.raw_transformer).double()
    args64 = argparse.Namespace(**{**vars(args), "mixed_precision": "no", "clip_range": OPEN_CLIP})
    return dataclasses.replace(ctx, args=args64, transformer=model, raw_transformer=model, counter=None)


def gradient_part(ctx, args, prepared, config, samples):
    """Per group position: cos / relative error of exact and JAGG in the run's precision, in float32,
    and JAGG in float64, each against the exact float64 group gradient (see the module doc)."""
    from dancegrpo import trainer
    rollout = prepared.rollout
    m = min(samples, prepared.advantages.numel())
    steps = prepared.selection.steps[:m]
    ctx64 = _float64_context(ctx, args)
    rollout64 = trainer.Rollout(rollout.latents.double(), rollout.log_probs.double(), [], rollout.rewards)
    cond64 = {k: v.double() if v.is_floating_point() else v for k, v in prepared.cond.items()}
    open_args = argparse.Namespace(**{**vars(args), "clip_range": OPEN_CLIP})
    contexts = {"run": dataclasses.replace(ctx, args=open_args),
                "float32": dataclasses.replace(ctx, args=argparse.Namespace(**{**vars(open_args),
                                                                               "mixed_precision": "no"})),
                "float64": ctx64}

    def batches(which):
        c = contexts[which]
        r, cond, adv = ((rollout64, cond64, prepared.advantages.double()) if which == "float64"
                        else (rollout, prepared.cond, prepared.advantages))
        return c, lambda idx: trainer.make_update_batch(c, r, cond, adv, idx, steps[idx], prepared.normaliser)

    def gradient(which, mode, cols):
        c, make_batch = batches(which)
        c.transformer.train()
        accumulate_group(c, make_batch, cols, mode if cols.shape[1] > 1 else "exact", args.update_batch_size,
                         config.alpha)
        return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                for p in c.raw_transformer.parameters() if p.requires_grad]

    rows = []
    for group, cols in measured_groups(steps, config.window, "trained", rollout.log_probs.shape[1] - 1):
        exact64 = gradient("float64", "exact", cols)
        row = dict(group=group.index, positions=list(group.members), size=group.size,
                   mean_t=float(ctx.timesteps.to(cols.device)[cols].mean()))
        for which, mode in GRADIENTS:
            similarity = gradient_similarity(exact64, gradient(which, mode, cols), over_ranks=False)
            row[f"cos_{which}_{mode}"], row[f"relerr_{which}_{mode}"] = similarity.cos, similarity.relerr
        rows.append(row)
    for c in contexts.values():
        c.transformer.zero_grad(set_to_none=True)
    return dict(samples=m, groups=rows)


def _module_outputs(model, run):
    """{name: flattened float64 output} of the model's modules one or two levels deep, over one call."""
    found, handles = {}, []
    for name, sub in model.named_modules():
        if name and name.count(".") <= 1:
            def keep(module, inputs, output, name=name):
                out = output[0] if isinstance(output, tuple) else output
                if torch.is_tensor(out):
                    found[name] = out.detach().double().flatten()
            handles.append(sub.register_forward_hook(keep))
    try:
        with torch.no_grad():
            run()
    finally:
        for handle in handles:
            handle.remove()
    return found


def layers_part(ctx, args, prepared):
    """Where the run's precision departs from float64 in one forward: the relative error of each
    module's output (one or two levels deep) on the first LAYER_SAMPLES samples at the middle
    transition, and of the velocity."""
    from dancegrpo.algo.rollout import predict_velocity
    ctx64 = _float64_context(ctx, args)
    n, k = min(LAYER_SAMPLES, prepared.advantages.numel()), args.sampling_steps // 2
    z, t = prepared.rollout.latents[:n, k], ctx.timesteps[k].expand(n).to(ctx.device)
    cond = {key: value[:n] for key, value in prepared.cond.items()}
    cond64 = {key: value.double() if value.is_floating_point() else value for key, value in cond.items()}
    run = _module_outputs(ctx.raw_transformer, lambda: predict_velocity(ctx, z, t, cond))
    exact = _module_outputs(ctx64.raw_transformer, lambda: predict_velocity(ctx64, z.double(), t, cond64))
    rows = [dict(module=name, relerr=float((run[name] - exact[name]).norm() / exact[name].norm()),
                 rms=float(exact[name].norm() / exact[name].numel() ** 0.5))
            for name in run if name in exact and run[name].shape == exact[name].shape and exact[name].norm() > 0]
    return dict(samples=n, transition=k, modules=rows)


def measure(module, args, parts, update_precision, samples):
    from dancegrpo import trainer
    ctx = trainer.setup(args, module.FAMILY(args))
    config = jagg_config(args)
    prepared = trainer.prepare_update(ctx, keep_outputs=True, step=1)
    result = dict(family=ctx.family.name, num_params=ctx.num_params, precision=args.mixed_precision or "default",
                  update_precision=update_precision, clip_range=args.clip_range, samples=prepared.advantages.numel(),
                  sampling_steps=args.sampling_steps, update_batch_size=args.update_batch_size,
                  sample_batch_size=args.sample_batch_size, jagg=config.as_dict(), threads=torch.get_num_threads())
    if "ratio" in parts:
        result["ratio"] = ratio_part(ctx, args, prepared, config, update_precision)
    if "gradient" in parts:
        result["gradient"] = gradient_part(ctx, args, prepared, config, samples)
    if "layers" in parts:
        result["layers"] = layers_part(ctx, args, prepared)
    ctx.counter.remove()
    return result


def format_report(r):
    lines = [f"## Precision: {r['family']} ({r['num_params'] / 1e6:.2f}M params), rollout in {r['precision']}, "
             f"update forwards in {r['update_precision']}; {r['samples']} samples, rollout batch "
             f"{r['sample_batch_size']}, update micro-batch {r['update_batch_size']}, W {r['jagg']['window']}, "
             f"jagg_frac {r['jagg']['jagg_frac']}"]
    if "ratio" in r:
        lines += ["", f"On-policy ratio r at the first update (every sample before any optimizer step), clip range "
                      f"{r['clip_range']:g}: mean / max |r - 1| and the fraction clipped, per transition k", "",
                  "| k | " + " | ".join(f"{name}: mean, max, clipped" for name in r["ratio"]) + " |",
                  "|---|" + "---|" * len(r["ratio"])]
        per_k = {name: {row["transition"]: row for row in entry["per_transition"]}
                 for name, entry in r["ratio"].items()}
        for k in sorted(set().union(*[set(v) for v in per_k.values()])):
            cells = []
            for name in r["ratio"]:
                row = per_k[name].get(k)
                cells.append("-" if row is None else
                             f"{row['mean_abs_dev']:.1e}, {row['max_abs_dev']:.1e}, {row['clip_frac']:.3f}")
            lines.append(f"| {k} | " + " | ".join(cells) + " |")
        lines += ["", "| update | pairs scored | clipped | clipped by vanilla too | clipped, vanilla not | vanilla "
                      "clipped, this not |", "|---|---|---|---|---|---|"]
        for name, entry in r["ratio"].items():
            lines.append(f"| {name} | {entry['pairs']} | {entry['clipped_pairs']} | {entry['clipped_with_vanilla']} | "
                         f"{entry['clipped_not_vanilla']} | {entry['vanilla_clipped_not_this']} |")
    if "gradient" in r:
        g = r["gradient"]
        lines += ["", f"Group gradients over {g['samples']} samples against the exact float64 one (the clip open): "
                      "cos [relative error]", "",
                  "| group | members | mean t | exact, run's precision | JAGG, run's precision | exact, float32 | "
                  "JAGG, float32 | JAGG, float64 |", "|---|---|---|---|---|---|---|---|"]
        for row in g["groups"]:
            cells = [f"{row[f'cos_{w}_{m}']:.5f} [{row[f'relerr_{w}_{m}']:.1e}]" for w, m in GRADIENTS]
            lines.append(f"| {row['group']}{' (size 1)' if row['size'] == 1 else ''} | {row['positions']} | "
                         f"{row['mean_t']:.3f} | " + " | ".join(cells) + " |")
    if "layers" in r:
        lay = r["layers"]
        lines += ["", f"One forward in the run's precision against float64, module by module "
                      f"({lay['samples']} samples, transition {lay['transition']}): relative error of the output "
                      "(its rms in float64; a module called twice shows its last call)", "",
                  "| module | relative error | rms |", "|---|---|---|"]
        lines += [f"| {m['module']} | {m['relerr']:.2e} | {m['rms']:.3g} |" for m in lay["modules"]]
    return "\n".join(lines)


def add_precision_args(parser):
    g = parser.add_argument_group("precision")
    g.add_argument("--prec_parts", default=",".join(PARTS), help=f"Comma list of {PARTS}.")
    g.add_argument("--prec_update_precision", choices=("same", "no", "bf16"), default="same",
                   help="The ratio part's update forwards: the run's precision (same), float32 (no) or bf16.")
    g.add_argument("--prec_samples", type=int, default=32, help="Samples of the gradient part.")
    g.add_argument("--prec_json", default=None, help="Write the numbers here (JSON).")
    g.add_argument("--prec_md", default=None, help="Write the report here (markdown).")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    module, parser, rest = trainer_cli(argv, "jagg_patch.tools.precision", __doc__, add_precision_args)
    from dancegrpo.args import parse_args
    from dancegrpo.errors import exit_on_config_error
    args = parse_args(parser, rest)
    check_trajectory(args)
    parts = [p.strip() for p in args.prec_parts.split(",") if p.strip()]
    if not parts or any(p not in PARTS for p in parts):
        fail(f"--prec_parts takes a comma list of {PARTS}, got {args.prec_parts!r}")
    if args.jagg_frac == "auto":
        fail("jagg_patch.tools.precision measures a fixed routing: give --jagg_frac a number (1: every group)")
    if args.jagg_grouping != "trained":
        fail("jagg_patch.tools.precision compares JAGG with vanilla on vanilla's trained transitions: use the "
             "default --jagg_grouping trained")
    if args.prec_samples < 1:
        fail("--prec_samples must be >= 1")
    update_precision = args.mixed_precision if args.prec_update_precision == "same" else args.prec_update_precision
    result = exit_on_config_error(measure)(module, args, parts, update_precision, args.prec_samples)
    report = format_report(result)
    print_and_write(report, result, args.prec_json, args.prec_md)
    return result


if __name__ == "__main__":
    main()
