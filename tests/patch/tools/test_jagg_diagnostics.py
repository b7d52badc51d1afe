"""The diagnostics table: window 2 must read exact; wider windows must rank JAGG above the ablation."""
import pytest

import dancegrpo.train_grpo_flux as flux
from jagg_patch.tools.diagnostics import format_table, run_diagnostics

GEOMETRY = ["--train_batch_size", 1, "--num_generations", 4, "--gradient_accumulation_steps", 4,
        "--sample_batch_size", 4, "--update_batch_size", 4, "--timestep_fraction", 1.0]


def diag_args(make_args, window, grouping="trained"):
    args = make_args(*GEOMETRY)
    args.jagg_window, args.jagg_frac, args.jagg_mode = window, 1.0, "jagg"
    args.jagg_grouping, args.jagg_alpha = grouping, "timestep"
    args.diag_samples, args.diag_warmup_steps = 4, 0
    return args


def test_window_two_reads_exact(make_args):
    rows = run_diagnostics(flux, diag_args(make_args, 2))
    assert [r["positions"] for r in rows] == [[0, 1], [2, 3], [4, 5], [6]]
    for r in rows:
        assert r["cos_jagg"] == pytest.approx(1.0, abs=1e-6) and r["relerr_jagg"] < 1e-5
        assert r["relerr_endpoints"] < 1e-5


def test_wider_window_table(make_args):
    rows = run_diagnostics(flux, diag_args(make_args, 3))
    table = format_table(rows, 3)
    assert "cos JAGG" in table and "(size 1: exact)" in table
    for r in rows[:2]:
        assert 0.5 < r["cos_jagg"] < 1 - 1e-6          # an approximation, not exact...
        assert r["cos_jagg"] > r["cos_endpoints"]     # ...and better than dropping the middles
        assert r["relerr_jagg"] < r["relerr_endpoints"]


def test_window_grouping_rows_are_trajectory_windows(make_args):
    """Rows = windows 0, 1, 2 of the trajectory (S 8: transitions 0-2, 3-5, 6) on every sample,
    with both alpha rules and the ablation; a window of one member reads exact."""
    rows = run_diagnostics(flux, diag_args(make_args, 3, "window"))
    assert [r["positions"] for r in rows] == [[0, 1, 2], [3, 4, 5], [6]]
    assert rows[0]["mean_t"] > rows[1]["mean_t"] > rows[2]["mean_t"]     # high noise first
    for r in rows[:2]:
        for key in ("jagg", "jagg_index"):
            assert 0.5 < r[f"cos_{key}"] < 1 - 1e-6
        assert r["cos_jagg_index"] != r["cos_jagg"]     # the shifted schedule is not even in t
        assert r["cos_endpoints"] < min(r["cos_jagg"], r["cos_jagg_index"])
    for key in ("jagg", "jagg_index", "endpoints"):
        assert rows[2][f"cos_{key}"] == pytest.approx(1.0, abs=1e-6)
    table = format_table(rows, 3, "window", "index")
    assert "per trajectory window" in table and "cos JAGG i*" in table


def test_parameter_subset_measures_only_those_gradients(make_args):
    """--diag_params: backward skips the other parameters, and the numbers are those of
    the selected slice of the full gradient (checked against an explicit flat computation)."""
    import torch
    from dancegrpo import trainer
    from dancegrpo.algo.grpo import choose_train_steps
    from jagg_patch.tools.diagnostics import accumulate_group, group_similarities, measured_groups, select_parameters
    from jagg_patch.plan import plan_groups

    args = diag_args(make_args, 3)
    ctx = trainer.setup(args, flux.FAMILY(args))
    cond, captions = trainer.expand_groups(args, next(ctx.loader))
    rollout = trainer.sample_reference_model(ctx, cond, captions, torch.Generator().manual_seed(0))
    adv = torch.randn(len(captions), generator=torch.Generator().manual_seed(1))
    steps = choose_train_steps(len(captions), args.sampling_steps - 1, 7, torch.Generator().manual_seed(2))

    def make_batch(idx):
        return trainer.make_update_batch(ctx, rollout, cond, adv, idx, steps[idx], 28)

    names = [n for n, _ in ctx.raw_transformer.named_parameters() if n.startswith("single_transformer_blocks.0.")]
    group = plan_groups(range(7), 3, 1.0)[0]
    cols = steps.sort(dim=1).values[:, list(group.members)]
    full = {}
    for mode in ("exact", "jagg"):
        accumulate_group(ctx, make_batch, cols, mode, 4)
        full[mode] = torch.cat([dict(ctx.raw_transformer.named_parameters())[n].grad.reshape(-1).double()
                                for n in names])
    expected_cos = float(full["jagg"] @ full["exact"] / (full["jagg"].norm() * full["exact"].norm()))

    select_parameters(ctx.raw_transformer, r"^single_transformer_blocks\.0\.")
    assert {n for n, p in ctx.raw_transformer.named_parameters() if p.requires_grad} == set(names)
    row = group_similarities(ctx, make_batch, measured_groups(steps, 3), 4)[0]
    assert row["cos_jagg"] == pytest.approx(expected_cos, abs=1e-9)
    assert all(p.grad is None for p in ctx.raw_transformer.parameters() if not p.requires_grad)
    with pytest.raises(ValueError, match="matches no parameter"):
        select_parameters(ctx.raw_transformer, "no_such_layer")
