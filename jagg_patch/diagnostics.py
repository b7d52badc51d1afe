"""How close is the JAGG group gradient to the exact one? (the paper's cosine table)

    python -m jagg_patch.diagnostics dancegrpo.train_grpo_flux --preset tiny --output_dir X \\
        [--jagg_window W] [--diag_samples N] [--diag_warmup_steps K]

For ONE rollout, per group index (denoising order, all groups planned as JAGG), the
gradient of that group summed over N samples is computed three ways: exact per-step,
JAGG and the endpoints ablation. Printed: cosine and relative norm error to exact.
Use it to choose --jagg_frac: route to JAGG the leading groups whose cosine is high.
"""
import sys

import torch

from .cli import trainer_cli
from .core import jagg_group_backward, plan_groups

MODES = ("exact", "jagg", "endpoints")


def _flat_grad(model):
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).double()
                      for p in model.parameters() if p.requires_grad])


def group_gradients(ctx, make_batch, steps, window, batch_size):
    """{(group index, mode): flat gradient} over all samples in `steps` [N, n].

    make_batch(sample_idx) -> UpdateBatch for those samples (the trainer's closures)."""
    ks = steps.sort(dim=1).values
    groups = plan_groups(range(ks.shape[1]), window, 1.0)
    grads = {}
    for group in groups:
        for mode in MODES:
            ctx.transformer.zero_grad(set_to_none=True)
            for start in range(0, ks.shape[0], batch_size):
                idx = torch.arange(start, min(start + batch_size, ks.shape[0]), device=ks.device)
                batch = make_batch(idx)
                cols = ks[idx][:, list(group.members)]
                jagg_group_backward(lambda j: batch.predict(cols[:, j]), lambda j, v: batch.step_loss(cols[:, j], v),
                                    batch.timesteps.to(cols.device)[cols].T, mode if group.size > 1 else "exact")
            grads[group.index, mode] = _flat_grad(ctx.raw_transformer)
    ctx.transformer.zero_grad(set_to_none=True)
    return groups, grads


def similarity_rows(groups, grads, timesteps=None, ks=None):
    rows = []
    for g in groups:
        exact = grads[g.index, "exact"]
        row = dict(group=g.index, positions=list(g.members), size=g.size, exact_norm=float(exact.norm()))
        for mode in ("jagg", "endpoints"):
            got = grads[g.index, mode]
            denom = float(exact.norm() * got.norm())
            row[f"cos_{mode}"] = float(got @ exact) / denom if denom > 0 else float("nan")
            row[f"relerr_{mode}"] = float((got - exact).norm() / exact.norm()) if exact.norm() > 0 else float("nan")
        if timesteps is not None and ks is not None:
            row["mean_t"] = float(timesteps.to(ks.device)[ks[:, list(g.members)]].mean())
        rows.append(row)
    return rows


def format_table(rows, window):
    head = (f"JAGG gradient vs exact, per group (window {window}; cos = cosine similarity, "
            "relerr = |g - g_exact| / |g_exact|)\n"
            f"{'group':>5} {'positions':<14} {'mean t':>7} {'cos JAGG':>9} {'relerr':>8} "
            f"{'cos endpts':>10} {'relerr':>8}")
    lines = [head]
    for r in rows:
        lines.append(f"{r['group']:>5} {str(r['positions']):<14} {r.get('mean_t', float('nan')):>7.3f} "
                     f"{r['cos_jagg']:>9.4f} {r['relerr_jagg']:>8.4f} {r['cos_endpoints']:>10.4f} "
                     f"{r['relerr_endpoints']:>8.4f}" + ("   (size 1: exact)" if r["size"] == 1 else ""))
    return "\n".join(lines)


def run_diagnostics(module, args):
    """Set up the trainer, optionally train a few vanilla steps, then measure one rollout."""
    ctx = setup_diagnostics(module, args)
    rows = measure_rollout(ctx, args, ctx.step + 1)
    ctx.counter.remove()
    return rows


def setup_diagnostics(module, args):
    """trainer.setup, then --diag_warmup_steps vanilla training steps."""
    from dancegrpo import trainer
    ctx = trainer.setup(args, module.FAMILY(args))
    for _ in range(args.diag_warmup_steps):
        ctx.step += 1
        module.train_one_step(ctx)
    return ctx


def measure_rollout(ctx, args, step):
    """The per-group rows for one rollout drawn with the generators of training step `step`."""
    from dancegrpo import trainer
    from dancegrpo.grpo import choose_train_steps, num_train_timesteps
    noise_gen, host_gen = trainer.step_generators(ctx, step)
    cond, captions = trainer.expand_groups(args, next(ctx.loader))
    cond = {k: v.to(ctx.device) for k, v in cond.items()}
    rollout = trainer.sample_reference_model(ctx, cond, captions, noise_gen)
    advantages = trainer.compute_advantages(ctx, rollout.rewards, rollout.rewards, host_gen)
    num_samples = min(args.diag_samples, rollout.rewards.numel())
    n = num_train_timesteps(rollout.log_probs.shape[1] - 1, args.timestep_fraction)
    steps = choose_train_steps(num_samples, rollout.log_probs.shape[1] - 1, n, host_gen).to(ctx.device)
    normaliser = args.gradient_accumulation_steps * n
    ctx.transformer.train()

    def make_batch(idx):
        return trainer.make_update_batch(ctx, rollout, cond, advantages, idx, steps[idx], normaliser)

    groups, grads = group_gradients(ctx, make_batch, steps, args.jagg_window, args.update_batch_size)
    return similarity_rows(groups, grads, ctx.timesteps, steps.sort(dim=1).values)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    module, parser, rest = trainer_cli(argv, "jagg_patch.diagnostics", __doc__)
    from dancegrpo.args import parse_args
    g = parser.add_argument_group("diagnostics")
    g.add_argument("--diag_samples", type=int, default=32, help="Samples of the rollout to measure on.")
    g.add_argument("--diag_warmup_steps", type=int, default=0, help="Vanilla training steps before measuring.")
    args = parse_args(parser, rest)
    rows = run_diagnostics(module, args)
    print(format_table(rows, args.jagg_window), flush=True)
    return rows


if __name__ == "__main__":
    main()
