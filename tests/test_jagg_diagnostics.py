"""The diagnostics table: window 2 must read exact; wider windows must rank JAGG above the ablation."""
import pytest

import dancegrpo.train_grpo_flux as flux
from jagg_patch.diagnostics import format_table, run_diagnostics

FAST = ["--train_batch_size", 1, "--num_generations", 4, "--gradient_accumulation_steps", 4,
        "--sample_batch_size", 4, "--update_batch_size", 4, "--timestep_fraction", 1.0]


def diag_args(make_args, window):
    args = make_args(*FAST)
    args.jagg_window, args.jagg_frac, args.jagg_mode = window, 1.0, "jagg"
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
