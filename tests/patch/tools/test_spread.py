"""Every "mean ± sd" the tools print is the sample sd (n - 1), by hand: the fidelity table, the
quality report and the monitor's per-position spread (which the routing's bound is made of)."""
import math

import pytest

VALUES = [0.91, 0.95, 0.99]
SAMPLE_SD = math.sqrt(sum((v - 0.95) ** 2 for v in VALUES) / (len(VALUES) - 1))   # 0.04


def test_the_fidelity_table_spreads_over_rollouts_by_the_sample_sd():
    from jagg_patch.tools.fidelity import aggregate
    keys = ("cos_jagg", "relerr_jagg", "cos_endpoints", "relerr_endpoints", "cos_jagg_index", "relerr_jagg_index")
    per_rollout = [[dict(positions=[0, 1], size=2, mean_t=0.5, **{k: v for k in keys})] for v in VALUES]
    (row,) = aggregate(per_rollout)
    assert row["cos_jagg_std"] == pytest.approx(SAMPLE_SD, rel=1e-12) and row["cos_jagg_mean"] == pytest.approx(0.95)


def test_the_monitor_spreads_cosines_by_the_sample_sd():
    from jagg_patch.monitor import spread
    out = spread({"jagg_cos/g0": VALUES, "jagg_cos/g1": [0.5], "jagg_relerr/g0": [1.0, 2.0]})
    assert out == {"jagg_cos_sd/g0": pytest.approx(SAMPLE_SD, rel=1e-12), "jagg_cos_n/g0": 3,
                   "jagg_cos_sd/g1": 0.0, "jagg_cos_n/g1": 1}


def test_the_one_spread_drops_nan_and_says_how_many_it_kept():
    from jagg_patch.spread import spread
    found = spread([*VALUES, float("nan")])
    assert found["sd"] == pytest.approx(SAMPLE_SD, rel=1e-12) and found["n"] == 3
    assert (found["min"], found["max"]) == (0.91, 0.99)
    assert math.isnan(spread([float("nan")])["mean"]) and spread([0.3])["sd"] == 0.0
