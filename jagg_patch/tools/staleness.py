"""What `--jagg_reuse_rollout always` costs in gradient: stale rollout outputs against fresh forwards.

    python -m jagg_patch.tools.staleness dancegrpo.train_grpo_flux --preset small --output_dir runs/stale \\
        [--jagg_window 4 --jagg_frac 0.6 ...] [--stale_steps 4] [--stale_json F]

One rollout (the generators of training step 1). Then, --stale_steps times: one optimizer step
(AdamW, the run's learning rate, on the JAGG gradient of every sample: what the update's earlier
GA blocks do to the parameters), after which the JAGG gradient of every sample is computed twice,
with the middle members' outputs from fresh no-grad forwards (what on_policy does after a step) and
from the rollout (what always does). Printed per number of optimizer steps since the rollout:
cos(always, fresh) and |always - fresh| / |fresh|, and the relative weight change. Step 0 (no
optimizer step yet) is on-policy: there both are the same gradient up to float rounding.
"""
import json
import sys

import torch

from ..cli import check_trajectory, jagg_config, trainer_cli
from ..similarity import gradient_similarity
from ..update import make_policy_update


def _grads(ctx):
    return torch.cat([p.grad.reshape(-1).double() for p in ctx.raw_transformer.parameters() if p.grad is not None])


def _weights(ctx):
    return torch.cat([p.detach().reshape(-1).double() for p in ctx.raw_transformer.parameters() if p.requires_grad])


def measure(module, args):
    from dancegrpo import trainer
    ctx = trainer.setup(args, module.FAMILY(args))
    prepared = trainer.prepare_update(ctx, module.select_train_steps, keep_outputs=True, step=1)
    rollout, cond, adv = prepared.rollout, prepared.cond, prepared.advantages
    config = jagg_config(args)
    steps, idx = prepared.selection.steps, torch.arange(adv.numel(), device=ctx.device)
    normaliser = prepared.normaliser

    def gradient(reuse, on_policy):
        ctx.optimizer.zero_grad(set_to_none=True)
        trainer.accumulate_policy_gradient(ctx, rollout, cond, adv, idx, steps, normaliser,
                                           make_policy_update(config.replace(reuse=reuse)), on_policy=on_policy)
        return _grads(ctx)

    ctx.transformer.train()
    start, rows = _weights(ctx), []
    for n in range(args.stale_steps + 1):
        if n:
            gradient("off", False)
            trainer.optimizer_step(ctx, f" (staleness step {n})")
        fresh, stale = gradient("off", n == 0), gradient("always", n == 0)
        similarity = gradient_similarity([fresh], [stale], over_ranks=False)
        rows.append(dict(optimizer_steps=n, cos=similarity.cos, relerr=similarity.relerr,
                         fresh_norm=similarity.exact_norm, stale_norm=float(stale.norm()),
                         weight_change=float((_weights(ctx) - start).norm() / start.norm())))
    ctx.counter.remove()
    return dict(family=ctx.family.name, learning_rate=args.learning_rate, samples=adv.numel(), rows=rows,
                jagg=config.as_dict())


def format_report(r):
    lines = [f"## Stale rollout outputs (--jagg_reuse_rollout always): {r['family']}, {r['samples']} samples, "
             f"lr {r['learning_rate']:g}, W {r['jagg']['window']}, jagg_frac {r['jagg']['jagg_frac']}", "",
             "| optimizer steps since the rollout | cos(always, fresh) | relerr | abs(fresh) | abs(always) | weight change |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {x['optimizer_steps']} | {x['cos']:.6f} | {x['relerr']:.2e} | {x['fresh_norm']:.3e} | "
              f"{x['stale_norm']:.3e} | {x['weight_change']:.2e} |" for x in r["rows"]]
    lines += ["", "A stale middle output keeps its old log-prob ratio (near 1, inside the PPO clip) where the "
              "fresh ratio has left the clip range and gives no gradient: always trains members that "
              "the clip has switched off (abs(fresh) 0: every ratio clipped)."]
    return "\n".join(lines)


def add_staleness_args(parser):
    parser.add_argument("--stale_steps", type=int, default=4, help="Optimizer steps after the rollout.")
    parser.add_argument("--stale_json", default=None, help="Write the numbers here (JSON).")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    module, parser, rest = trainer_cli(argv, "jagg_patch.tools.staleness", __doc__, add_staleness_args)
    from dancegrpo.args import parse_args
    from dancegrpo.errors import exit_on_config_error
    args = parse_args(parser, rest)
    check_trajectory(args)
    result = exit_on_config_error(measure)(module, args)
    print(format_report(result), flush=True)
    if args.stale_json:
        with open(args.stale_json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
