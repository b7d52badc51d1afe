"""How close is the JAGG group gradient to the exact one? (the paper's cosine table)

    python -m jagg_patch.tools.diagnostics dancegrpo.train_grpo_flux --preset tiny --output_dir X \\
        [--jagg_window W] [--jagg_grouping trained|window] [--jagg_alpha timestep|index] \\
        [--diag_samples N] [--diag_warmup_steps K]

For ONE rollout, per group (denoising order, all groups planned as JAGG), the gradient of
that group summed over N samples is computed four ways: exact per-step, JAGG with the
timestep alpha (the paper), JAGG with the index alpha (the authors' code) and the endpoints
ablation. Printed: cosine and relative norm error to exact. With --jagg_grouping trained a
row is a group of W consecutive trained transitions (positions in each sample's sorted
random subset); with window, a row is trajectory window g (transitions gW..gW+W-1, the
paper's "groups 0-2"), measured on every sample. Use it to choose --jagg_frac: route to
JAGG the leading groups whose cosine is high.
"""
import sys

if __name__ == "__main__":   # --help and flag errors, before torch loads
    from jagg_patch.tools.tool_args import add_diag_args as _flags, answer_first
    answer_first("jagg_patch.tools.diagnostics", __doc__, _flags)

import torch  # noqa: E402

from ..cli import check_trajectory, trainer_cli  # noqa: E402
from ..similarity import gradient_similarity  # noqa: E402
from ..update import group_backward, groups_of  # noqa: E402
from .tool_args import add_diag_args  # noqa: E402

# (row key, mode, alpha rule) of each approximation compared with the exact group gradient.
VARIANTS = (("jagg", "jagg", "timestep"), ("jagg_index", "jagg", "index"), ("endpoints", "endpoints", "timestep"))


def _trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def select_parameters(model, pattern):
    """Measure on the parameters whose name matches the regex `pattern` only.

    The others get requires_grad False, so backward neither computes nor stores their
    gradients: what makes the check fit for 12B / 20B models."""
    import re
    from dancegrpo.utils.fsdp_util import clean_param_name
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


def accumulate_group(ctx, make_batch, cols, mode, batch_size, alpha="timestep"):
    """The gradient of one group, summed over all samples, left in the parameters' .grad.
    cols: [N, w] the group's transitions of each sample."""
    ctx.transformer.zero_grad(set_to_none=True)
    for start in range(0, cols.shape[0], batch_size):
        idx = torch.arange(start, min(start + batch_size, cols.shape[0]), device=cols.device)
        c = cols[idx]
        group_backward(make_batch(idx), c, mode if c.shape[1] > 1 else "exact", alpha, "joint")


def _compare_to(params, exact):
    """(cos, relative error, |exact|) of the current .grad against `exact` (this process's, not
    summed over ranks)."""
    return tuple(gradient_similarity(exact, [p.grad for p in params], over_ranks=False))


def measured_groups(steps, window, grouping="trained", num_transitions=None):
    """[(group, cols [N, w])]: every group planned as JAGG, as the update enumerates them. trained:
    groups of the sorted trained transitions `steps` [N, n]; window: every trajectory window, on
    every sample (as if every sample trained every transition)."""
    if grouping == "window":
        steps = torch.arange(num_transitions, device=steps.device).expand(steps.shape[0], -1)
    return [(found.group, found.cols) for found in groups_of(steps, num_transitions, window, 1.0, grouping)]


def group_similarities(ctx, make_batch, groups, batch_size, timesteps=None):
    """Per group of `groups` (see measured_groups): cosine and relative error of each VARIANTS
    group gradient against the exact one, over all samples.

    make_batch(sample_idx) -> UpdateBatch for those samples (the trainer's closures).
    Memory: one extra copy of the (selected) gradient, the exact one of the current group."""
    params = _trainable(ctx.raw_transformer)
    rows = []
    for group, cols in groups:
        accumulate_group(ctx, make_batch, cols, "exact", batch_size)
        exact = [(p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone() for p in params]
        row = dict(group=group.index, positions=list(group.members), size=group.size)
        for key, mode, alpha in VARIANTS:
            accumulate_group(ctx, make_batch, cols, mode, batch_size, alpha)
            row[f"cos_{key}"], row[f"relerr_{key}"], row["exact_norm"] = _compare_to(params, exact)
        if timesteps is not None:
            row["mean_t"] = float(timesteps.to(cols.device)[cols].mean())
        rows.append(row)
        del exact
    ctx.transformer.zero_grad(set_to_none=True)
    return rows


def format_table(rows, window, grouping="trained", alpha="timestep"):
    mark = {a: "*" if a == alpha else "" for a in ("timestep", "index")}
    head = (f"JAGG gradient vs exact, per {'trajectory window' if grouping == 'window' else 'group'} "
            f"(window {window}, grouping {grouping}; cos = cosine similarity, relerr = |g - g_exact| / |g_exact|; "
            "alpha t = timestep rule, i = index rule, * = configured)\n"
            f"{'group':>5} {'members':<16} {'mean t':>7} {'cos JAGG t' + mark['timestep']:>11} {'relerr':>8} "
            f"{'cos JAGG i' + mark['index']:>11} {'relerr':>8} {'cos endpts':>10} {'relerr':>8}")
    lines = [head]
    for r in rows:
        lines.append(f"{r['group']:>5} {str(r['positions']):<16} {r.get('mean_t', float('nan')):>7.3f} "
                     f"{r['cos_jagg']:>11.4f} {r['relerr_jagg']:>8.4f} {r['cos_jagg_index']:>11.4f} "
                     f"{r['relerr_jagg_index']:>8.4f} {r['cos_endpoints']:>10.4f} {r['relerr_endpoints']:>8.4f}"
                     + ("   (size 1: exact)" if r["size"] == 1 else ""))
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
    # Vanilla's draw (the trained grouping's groups come from it; the cosines do not depend on the
    # loss normaliser), or each sample's SDE window under --sde_window_size.
    prepared = trainer.prepare_update(ctx, step=step)
    rollout = prepared.rollout
    num_samples, num_transitions = min(args.diag_samples, rollout.rewards.numel()), rollout.log_probs.shape[1] - 1
    steps = prepared.selection.steps[:num_samples]
    ctx.transformer.train()

    def make_batch(idx):
        return trainer.make_update_batch(ctx, rollout, prepared.cond, prepared.advantages, idx, steps[idx],
                                         prepared.normaliser)

    groups = measured_groups(steps, args.jagg_window, args.jagg_grouping, num_transitions)
    return group_similarities(ctx, make_batch, groups, args.update_batch_size, ctx.timesteps)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    module, parser, rest = trainer_cli(argv, "jagg_patch.tools.diagnostics", __doc__, add_diag_args)
    from dancegrpo.args import parse_args
    args = parse_args(parser, rest)
    check_trajectory(args)
    rows = run_diagnostics(module, args)
    print(format_table(rows, args.jagg_window, args.jagg_grouping, args.jagg_alpha), flush=True)
    return rows


if __name__ == "__main__":
    main()
