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


def _trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def select_parameters(model, pattern):
    """Measure on the parameters whose name matches the regex `pattern` only.

    The others get requires_grad False, so backward neither computes nor stores their
    gradients: what makes the check fit for 12B / 20B models."""
    import re
    from dancegrpo.distributed import clean_param_name
    from dancegrpo.errors import ConfigError
    if not pattern:
        return
    rx, chosen = re.compile(pattern), 0
    for name, p in model.named_parameters():
        keep = rx.search(clean_param_name(name)) is not None
        p.requires_grad_(keep)
        chosen += keep
    if not chosen:
        raise ConfigError(f"--diag_params {pattern!r} matches no parameter name of the transformer")


def _accumulate_group(ctx, make_batch, ks, group, mode, batch_size):
    """The gradient of one group, summed over all samples, left in the parameters' .grad."""
    ctx.transformer.zero_grad(set_to_none=True)
    for start in range(0, ks.shape[0], batch_size):
        idx = torch.arange(start, min(start + batch_size, ks.shape[0]), device=ks.device)
        batch = make_batch(idx)
        cols = ks[idx][:, list(group.members)]
        jagg_group_backward(lambda j: batch.predict(cols[:, j]), lambda j, v: batch.step_loss(cols[:, j], v),
                            batch.timesteps.to(cols.device)[cols].T, mode if group.size > 1 else "exact")


def _compare_to(params, exact):
    """(cos, relative error) of the current .grad against `exact`, reduced parameter by
    parameter in float64 so no flat copy of the gradient is ever built."""
    dot = got2 = exact2 = diff2 = 0.0
    for p, e in zip(params, exact):
        g = (p.grad if p.grad is not None else torch.zeros_like(p)).double()
        e = e.double()
        dot += float((g * e).sum())
        got2 += float((g * g).sum())
        exact2 += float((e * e).sum())
        diff2 += float(((g - e) ** 2).sum())
    cos = dot / (got2 * exact2) ** 0.5 if got2 * exact2 > 0 else float("nan")
    return cos, (diff2 / exact2) ** 0.5 if exact2 > 0 else float("nan"), exact2 ** 0.5


def group_similarities(ctx, make_batch, steps, window, batch_size, timesteps=None):
    """Per group index (all groups planned as JAGG): cosine and relative error of the JAGG
    and endpoints group gradients against the exact one, over all samples in `steps` [N, n].

    make_batch(sample_idx) -> UpdateBatch for those samples (the trainer's closures).
    Memory: one extra copy of the (selected) gradient, the exact one of the current group."""
    ks = steps.sort(dim=1).values
    params = _trainable(ctx.raw_transformer)
    rows = []
    for group in plan_groups(range(ks.shape[1]), window, 1.0):
        _accumulate_group(ctx, make_batch, ks, group, "exact", batch_size)
        exact = [(p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone() for p in params]
        row = dict(group=group.index, positions=list(group.members), size=group.size)
        for mode in ("jagg", "endpoints"):
            _accumulate_group(ctx, make_batch, ks, group, mode, batch_size)
            row[f"cos_{mode}"], row[f"relerr_{mode}"], row["exact_norm"] = _compare_to(params, exact)
        if timesteps is not None:
            row["mean_t"] = float(timesteps.to(ks.device)[ks[:, list(group.members)]].mean())
        rows.append(row)
        del exact
    ctx.transformer.zero_grad(set_to_none=True)
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
    select_parameters(ctx.raw_transformer, getattr(args, "diag_params", None))
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

    return group_similarities(ctx, make_batch, steps, args.jagg_window, args.update_batch_size, ctx.timesteps)


def add_diag_args(parser):
    g = parser.add_argument_group("diagnostics")
    g.add_argument("--diag_samples", type=int, default=32, help="Samples of the rollout to measure on.")
    g.add_argument("--diag_warmup_steps", type=int, default=0, help="Vanilla training steps before measuring.")
    g.add_argument("--diag_params", default=None,
                   help="Regex: measure the gradient of matching parameters only, e.g. "
                        "'transformer_blocks\\.0\\.' (needed to fit 12B / 20B models; default: all).")
    return g


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    module, parser, rest = trainer_cli(argv, "jagg_patch.diagnostics", __doc__)
    from dancegrpo.args import parse_args
    add_diag_args(parser)
    args = parse_args(parser, rest)
    rows = run_diagnostics(module, args)
    print(format_table(rows, args.jagg_window), flush=True)
    return rows


if __name__ == "__main__":
    main()
