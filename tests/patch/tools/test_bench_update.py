"""jagg_patch.tools.bench_update's _auto modes on the tiny preset: every timed run of an auto mode
measures (the monitor's seconds are in each timing), the routing it chose is reported, and the step
at the run's cadence adds 1/N of the measurement to the routed update."""
import pytest

from jagg_patch.tools.bench_update import main

# S 8 -> 7 transitions, fraction 0.6 -> 4 trained; W 3: groups [3, 1], so position 0 is the only
# group the monitor can measure (a single member has no JAGG form).
GEOMETRY = ["--train_batch_size", "1", "--num_generations", "4", "--gradient_accumulation_steps", "4",
            "--sample_batch_size", "4", "--update_batch_size", "4", "--jagg_window", "3"]


def bench(cache_dir, tmp_path, *flags):
    return main(["dancegrpo.train_grpo_flux", "--preset", "tiny", "--cache_dir", cache_dir,
                 "--output_dir", str(tmp_path / "run"), *GEOMETRY, "--bench_reps", "2", "--bench_unit_reps", "1",
                 "--bench_md", str(tmp_path / "bench.md"), *flags])


def test_an_auto_mode_measures_in_every_timed_run_and_reports_its_routing(cache_dir, tmp_path, capsys):
    result = bench(cache_dir, tmp_path, "--bench_modes", "vanilla,jagg_split,jagg_split_auto", "--jagg_frac", "1",
                   "--jagg_min_cos", "-1", "--jagg_monitor_every", "5")
    auto, fixed = result["modes"]["jagg_split_auto"], result["modes"]["jagg_split"]
    assert len(result["monitor_times_s"]["jagg_split_auto"]) == 2
    assert all(m > 0 for m in result["monitor_times_s"]["jagg_split_auto"])
    assert auto["routed"] == [0] and list(auto["smoothed_cos"]) == [0] and -1 <= auto["smoothed_cos"][0] <= 1
    assert 0 < auto["routed_update_s"] < auto["update_s"] and auto["predicted_update_s"] is None
    assert result["monitor_every"] == 5
    assert auto["cadence_step_s"] == pytest.approx(result["rollout_s"] + auto["routed_update_s"] + auto["monitor_s"] / 5)
    assert auto["cadence_step_ratio"] == pytest.approx(auto["cadence_step_s"] / result["modes"]["vanilla"]["step_s"])
    assert fixed["predicted_update_s"] > 0 and "monitor_s" not in fixed
    report = (tmp_path / "bench.md").read_text()
    assert "| jagg_split_auto |" in report and "at one measurement every 5 steps" in report and "[0] (g0 " in report
    assert "--jagg_min_cos is the threshold" not in capsys.readouterr().out   # the _auto mode reads it


@pytest.mark.parametrize("flags, message", [
    (["--jagg_frac", "auto"], "with a mode ending in _auto"),
    (["--bench_modes", "vanilla,exact_auto"], "a JAGG mode may end in _auto"),
])
def test_bad_auto_requests_are_refused_before_anything_loads(cache_dir, tmp_path, flags, message):
    with pytest.raises(SystemExit, match=message):
        bench(cache_dir, tmp_path, *flags)


def test_the_deferred_modes_run_beside_the_restated_ones(cache_dir, tmp_path):
    """deferred / deferred_reuse: vanilla's own update through the proxy, timed with its flush; predicted
    by the cost model's deferred schedules (every member called without grad, or taken from the rollout;
    then 2 replays and their backwards per JAGG group)."""
    from jagg_patch.plan import Group
    from jagg_patch.tools.cost_model import group_passes
    assert group_passes(Group(0, (0, 1, 2, 3), True), "jagg", "deferred") == (2, 4, 2)
    assert group_passes(Group(0, (0, 1, 2, 3), True), "jagg", "deferred_reuse") == (2, 0, 2)
    assert group_passes(Group(1, (4,), False), "jagg", "deferred") == (1, 1, 1)
    result = bench(cache_dir, tmp_path, "--bench_modes",
                   "vanilla,jagg_split_reuse,deferred,deferred_reuse,deferred_batched_reuse", "--jagg_frac", "1")
    modes, units = result["modes"], result["unit_costs_s"]
    assert all(modes[m]["update_s"] > 0 for m in ("deferred", "deferred_reuse"))
    # GA covers the rollout, so every sample is on-policy: with reuse the deferred passes are the restated ones
    assert modes["deferred_reuse"]["predicted_update_s"] == pytest.approx(modes["jagg_split_reuse"]["predicted_update_s"])
    # without, every member is called without grad: 4 samples x (one group of 3 + one row of 1)
    extra = 4 * (3 * units["f_nograd"] + 1 * units["f_nograd"]) / 4
    assert modes["deferred"]["predicted_update_s"] == pytest.approx(
        modes["deferred_reuse"]["predicted_update_s"] + extra)
    report = (tmp_path / "bench.md").read_text()
    assert "| deferred_reuse |" in report and "| deferred_batched_reuse |" in report
    # each flush replays the restated plan's rows (4 samples x (2 endpoints + 1 exact row); the shared
    # first steps of --init_same_noise placed), in chunks of the calls' 4 rows, or of 8 when batched
    assert result["plan_replay_rows"] == 12
    for mode, chunk in (("deferred", 4), ("deferred_reuse", 4), ("deferred_batched_reuse", 8)):
        counts = result["deferred_replay"][mode]
        assert counts["rows"] + counts["zero_rows"] == 12 and counts["unplanned_exact_rows"] == 0, counts
        assert counts["backwards"] == -(-counts["rows"] // chunk), counts
    assert report.count(": the restated plan") == 3


def test_the_deferred_modes_refuse_the_window_grouping(cache_dir, tmp_path):
    with pytest.raises(SystemExit, match="deferred modes group the transitions vanilla's update trains"):
        bench(cache_dir, tmp_path, "--bench_modes", "vanilla,deferred", "--jagg_grouping", "window")
