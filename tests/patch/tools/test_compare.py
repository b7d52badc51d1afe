"""jagg_patch.tools.compare on two synthetic metrics files: values equal hand-computed ones, plots written,
bad input exits 2 with a message."""
import json
import math
import os
import subprocess
import sys

import pytest

from jagg_patch.tools.compare import compare, main, markdown_table, moving_average

COUNTS_VANILLA = dict(transformer_forwards_grad=36, transformer_forwards_nograd=64, transformer_backwards=36)
COUNTS_JAGG = dict(transformer_forwards_grad=20, transformer_forwards_nograd=80, transformer_backwards=20,
                   activation_peak_mb=114.5)   # runs from before the metric existed have none


def write_run(path, rewards, step_times, rollout_times, counts, extra_lines=()):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        for i, (r, t, ro) in enumerate(zip(rewards, step_times, rollout_times), 1):
            f.write(json.dumps(dict(step=i, reward_mean=r, step_time_s=t, rollout_time_s=ro,
                                    update_time_s=t - ro, **counts)) + "\n")
        for line in extra_lines:
            f.write(line + "\n")
    return str(path)


@pytest.fixture
def two_runs(tmp_path):
    # vanilla: 5 steps; step 1 is warm-up (slow) and left out of the medians (skip_first=1).
    a = write_run(tmp_path / "vanilla", [1.0, 2.0, 3.0, 4.0, 5.0], [9.0, 4.0, 5.0, 6.0, 4.0],
                  [5.0, 2.0, 2.0, 2.0, 2.0], COUNTS_VANILLA)
    # jagg: 4 steps, plus a re-logged step 4 (after a resume): the last record of a step wins.
    b = write_run(tmp_path / "jagg", [0.0, 4.0, 2.0, 1.0], [8.0, 3.0, 4.0, 3.5], [4.0, 2.0, 2.0, 2.0], COUNTS_JAGG,
                  extra_lines=[json.dumps(dict(step=4, reward_mean=6.0, step_time_s=3.0, rollout_time_s=2.0,
                                               update_time_s=1.0, **COUNTS_JAGG))])
    return a, b


def test_moving_average_by_hand():
    assert moving_average([1, 2, 3, 4, 5], 3) == [1.0, 1.5, 2.0, 3.0, 4.0]


def test_table_values_by_hand(two_runs):
    rows, curves = compare(list(two_runs), ["vanilla", "jagg"], ma_window=3, skip_first=1)
    v, j = rows
    assert (v["steps"], j["steps"]) == (5, 4)
    # medians over steps 2.. : vanilla times 4,5,6,4 -> 4.5; rollouts 2 -> 2; updates 2,3,4,2 -> 2.5
    assert v["step_time_s"] == pytest.approx(4.5)
    assert v["rollout_time_s"] == pytest.approx(2.0)
    assert v["update_time_s"] == pytest.approx(2.5)
    # jagg steps 2..4 (step 4 re-logged as 3.0): times 3,4,3 -> 3; updates 1,2,1 -> 1
    assert j["step_time_s"] == pytest.approx(3.0)
    assert j["update_time_s"] == pytest.approx(1.0)
    assert (v["forwards_grad_per_step"], v["forwards_nograd_per_step"], v["backwards_per_step"]) == (36, 64, 36)
    assert (j["forwards_grad_per_step"], j["backwards_per_step"]) == (20, 20)
    assert j["activation_peak_mb"] == pytest.approx(114.5) and math.isnan(v["activation_peak_mb"])
    assert "| 114.5 |" in markdown_table(rows) and "| n/a |" in markdown_table(rows)
    # MA(3): vanilla [1, 1.5, 2, 3, 4] -> final 4, best over full windows max(2, 3, 4) = 4
    assert v["final_ma_reward"] == pytest.approx(4.0) and v["best_ma_reward"] == pytest.approx(4.0)
    # jagg rewards [0, 4, 2, 6]: MA [0, 2, 2, 4] -> final 4; full windows (2, 4) -> best 4
    assert curves["jagg"]["reward"] == [0.0, 4.0, 2.0, 6.0]
    assert j["final_ma_reward"] == pytest.approx(4.0) and j["best_ma_reward"] == pytest.approx(4.0)
    # speedups vs the first run: 1 - 3/4.5 = 1/3; update 1 - 1/2.5 = 0.6; ratios 1.5x, 2.5x
    assert v["step_speedup"] == pytest.approx(0.0)
    assert j["step_speedup"] == pytest.approx(1 / 3)
    assert j["step_speedup_ratio"] == pytest.approx(1.5)
    assert j["update_speedup"] == pytest.approx(0.6)
    assert j["update_speedup_ratio"] == pytest.approx(2.5)
    table = markdown_table(rows)
    assert "| jagg | 4 | 3.000 | 2.000 | 1.000 | 20 | 80 | 20 | 114.5 | 4.0000 | 4.0000 | n/a | n/a | n/a | +33.3% (1.50x) " \
           "| +60.0% (2.50x) |" in table


def test_ratio_statistics_by_hand(tmp_path):
    """clip_frac and approx_kl are averaged over the steps, the ratio's range taken over all of them;
    a run that logged none shows n/a."""
    stats = [dict(clip_frac=0.0, approx_kl=0.0, ratio_min=1.0, ratio_max=1.0),
             dict(clip_frac=0.25, approx_kl=2e-6, ratio_min=0.9991, ratio_max=1.0004),
             dict(clip_frac=0.5, approx_kl=4e-6, ratio_min=0.9995, ratio_max=1.0012)]
    path = tmp_path / "run"
    os.makedirs(path)
    with open(path / "metrics.jsonl", "w") as f:
        for i, extra in enumerate(stats, 1):
            f.write(json.dumps(dict(step=i, reward_mean=0.0, step_time_s=1.0, rollout_time_s=0.5, update_time_s=0.5,
                                    **COUNTS_VANILLA, **extra)) + "\n")
    bare = write_run(tmp_path / "bare", [0.0] * 3, [1.0] * 3, [0.5] * 3, COUNTS_VANILLA)
    rows, _ = compare([str(path), bare], ["logged", "bare"], ma_window=3, skip_first=0)
    assert rows[0]["clip_frac"] == pytest.approx(0.25) and rows[0]["approx_kl"] == pytest.approx(2e-6)
    assert (rows[0]["ratio_min"], rows[0]["ratio_max"]) == (0.9991, 1.0012)
    assert all(math.isnan(rows[1][k]) for k in ("clip_frac", "approx_kl", "ratio_min", "ratio_max"))
    table = markdown_table(rows)
    assert "| 0.250 | 2.00e-06 | [0.9991, 1.0012] |" in table and "| n/a | n/a | n/a |" in table


def test_short_run_window_and_cli_outputs(two_runs, tmp_path, capsys):
    out = tmp_path / "cmp"
    rows = main([*two_runs, "--labels", "vanilla,jagg", "--out", str(out), "--ma_window", "10"])
    # windows longer than a run shrink to the run: MA over all 5 / all 4 steps
    assert rows[0]["ma_window"] == 5 and rows[0]["final_ma_reward"] == pytest.approx(3.0)
    assert rows[1]["ma_window"] == 4 and rows[1]["best_ma_reward"] == pytest.approx(3.0)
    printed = capsys.readouterr().out
    assert "| run | steps | step s |" in printed and "speedup" in printed
    for name in ("comparison.json", "comparison.csv", "comparison.md", "rewards.csv", "reward_curves.png",
                 "step_times.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    assert (out / "reward_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((out / "comparison.json").read_text())
    assert [r["label"] for r in data["runs"]] == ["vanilla", "jagg"]
    assert len((out / "rewards.csv").read_text().splitlines()) == 1 + 5 + 4


@pytest.mark.parametrize("case", ["missing", "no_metrics", "empty", "malformed"])
def test_bad_input_exits_2(tmp_path, case, two_runs, capsys):
    bad = tmp_path / "bad"
    if case != "missing":
        bad.mkdir()
    if case == "empty":
        (bad / "metrics.jsonl").write_text("\n")
    if case == "malformed":
        (bad / "metrics.jsonl").write_text('{"step": 1, "reward_mean": 1.0}\nnot json\n')
    expected = {"missing": "does not exist", "no_metrics": "metrics.jsonl", "empty": "no steps",
                "malformed": ":2: not a JSON line"}[case]
    argv = [two_runs[0], str(bad), "--no_plots"]
    if case == "missing":  # once through the real command line: message, no traceback, exit 2
        proc = subprocess.run([sys.executable, "-m", "jagg_patch.tools.compare", *argv], capture_output=True, text=True)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr
        assert expected in proc.stderr
        return
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert expected in capsys.readouterr().err


def test_monitored_runs_get_their_cosines_per_position_plotted(tmp_path):
    """Records with the monitor's jagg_cos/gP (only on measured steps) give per-position curves and a plot."""
    counts = dict(COUNTS_JAGG)
    path = write_run(tmp_path / "auto", [1.0, 2.0, 3.0], [3.0, 3.0, 3.0], [1.0, 1.0, 1.0], counts)
    lines = [json.loads(line) for line in open(os.path.join(path, "metrics.jsonl"))]
    lines[0].update({"jagg_cos/g0": 0.99, "jagg_cos/g1": 0.7})
    lines[2].update({"jagg_cos/g0": 0.98, "jagg_cos/g1": 0.72, "jagg_relerr/g0": 0.1})
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        f.write("".join(json.dumps(line) + "\n" for line in lines))
    plain = write_run(tmp_path / "vanilla", [1.0, 2.0, 3.0], [4.0, 4.0, 4.0], [1.0, 1.0, 1.0], COUNTS_VANILLA)
    out = tmp_path / "cmp"
    main([plain, path, "--out", str(out)])
    data = json.loads((out / "comparison.json").read_text())
    assert data["curves"]["auto"]["jagg_cos"] == {"0": {"steps": [1, 3], "cos": [0.99, 0.98]},
                                                  "1": {"steps": [1, 3], "cos": [0.7, 0.72]}}
    assert "jagg_cos" not in data["curves"]["vanilla"]
    assert (out / "jagg_cos.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_upstream_runs_read_as_this_trainers(tmp_path, capsys):
    """jagg_patch.upstream's jagg_metrics.jsonl (its last run when a folder holds several), and a plain
    upstream run's reward file (rewards only), beside this trainer's metrics.jsonl."""
    vanilla = write_run(tmp_path / "vanilla", [1.0, 2.0, 3.0], [4.0, 4.0, 4.0], [1.0, 1.0, 1.0], COUNTS_VANILLA)
    adapter = tmp_path / "upstream_jagg"
    adapter.mkdir()
    lines = [dict(step=s, run_id=run, reward_mean=r, reward_std=0.5, step_time_s=t, rollout_time_s=1.0,
                  update_time_s=t - 1.0, **COUNTS_JAGG)
             for run, rows in (("old", [(1, 9.0, 9.0)]), ("new", [(1, 1.5, 3.0), (2, 2.5, 2.0), (3, 3.5, 2.0)]))
             for s, r, t in rows]
    (adapter / "jagg_metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "hps_reward.txt").write_text("0.5000\n1.0000\n\n1.5000\n")
    rows, curves = compare([vanilla, str(adapter), str(plain / "hps_reward.txt"), str(plain)],
                           ["vanilla", "jagg", "file", "folder"], ma_window=2, skip_first=1)
    warned = capsys.readouterr().err
    assert "holds 2 runs; comparing the last one (run_id new)" in warned and "is a reward file" in warned
    assert curves["jagg"]["reward"] == [1.5, 2.5, 3.5] and rows[1]["step_time_s"] == pytest.approx(2.0)
    assert rows[1]["step_speedup_ratio"] == pytest.approx(2.0) and rows[1]["backwards_per_step"] == 20
    assert curves["file"] == curves["folder"] == {"steps": [1, 2, 3], "reward": [0.5, 1.0, 1.5],
                                                  "ma": [0.5, 0.75, 1.25]}
    assert math.isnan(rows[2]["step_time_s"]) and rows[2]["final_ma_reward"] == pytest.approx(1.25)
    (plain / "hps_reward.txt").write_text("0.5\nnan?\n")
    with pytest.raises(SystemExit):
        main([vanilla, str(plain), "--no_plots"])
    assert "hps_reward.txt:2: not a reward" in capsys.readouterr().err


def _one_line(capsys, argv, code):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = "\n".join(line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("warning: "))
    assert exc.value.code == code and len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_an_unwritable_out_is_one_line_exit_2_and_a_full_disk_exit_3(two_runs, tmp_path, capsys, monkeypatch):
    (tmp_path / "a_file").write_text("in the way")
    err = _one_line(capsys, [*two_runs, "--no_plots", "--out", str(tmp_path / "a_file" / "cmp")], 2)
    assert err.startswith("error: cannot write under --out") and "give a folder you can write to" in err
    import errno
    from dancegrpo.utils import atomic
    real = atomic.write_atomically
    written = []

    def full_after_two(path, write):
        if len(written) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        written.append(os.path.basename(path))
        return real(path, write)
    monkeypatch.setattr(atomic, "write_atomically", full_after_two)
    err = _one_line(capsys, [*two_runs, "--no_plots", "--out", str(tmp_path / "cmp")], 3)
    assert err.startswith("stopped: no space left to write under --out")
    assert sorted(os.listdir(tmp_path / "cmp")) == sorted(written)   # whole files only, no temporary


def _with_setup(run_dir, **config):
    os.makedirs(os.path.join(run_dir, "checkpoint-4-0"))
    with open(os.path.join(run_dir, "checkpoint-4-0", "run_config.json"), "w") as f:
        json.dump(config, f)


@pytest.mark.parametrize("field, a, b, said", [
    ("family", "flux", "qwenimage", "different models (vanilla: flux, jagg: qwenimage)"),
    ("preset", "digits", "digits_large", "different presets (vanilla: digits, jagg: digits_large)"),
    ("world_size", 1, 2, "different rank counts (vanilla: 1, jagg: 2)")])
def test_runs_of_different_models_presets_or_ranks_are_warned_about(two_runs, capsys, field, a, b, said):
    base = dict(family="flux", preset="digits", world_size=1)
    _with_setup(two_runs[0], **{**base, field: a})
    _with_setup(two_runs[1], **{**base, field: b})
    compare(list(two_runs), ["vanilla", "jagg"])
    err = capsys.readouterr().err
    assert said in err and err.count("the runs are of different") == 1


def _set_in_records(run_dir, **values):
    path = os.path.join(run_dir, "metrics.jsonl")
    records = [dict(json.loads(line), **values) for line in open(path)]
    with open(path, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))


def test_runs_of_different_precisions_are_warned_about(two_runs, capsys):
    _set_in_records(two_runs[0], precision="float32")
    _set_in_records(two_runs[1], precision="bf16 autocast")
    compare(list(two_runs), ["vanilla", "jagg"])
    assert "different precisions (vanilla: float32, jagg: bf16 autocast)" in capsys.readouterr().err
    _set_in_records(two_runs[1], precision="float32")
    compare(list(two_runs), ["vanilla", "jagg"])
    assert "different precisions" not in capsys.readouterr().err


@pytest.mark.parametrize("field", ["ratio_max", "approx_kl"])
def test_a_nan_ratio_statistic_flags_the_run_and_comparison_json_stays_json(two_runs, tmp_path, capsys, field):
    """A NaN ratio means NaN log-probs (the run diverged); comparison.json holds null for numbers a run
    could not give (a bare NaN is no JSON)."""
    path = os.path.join(two_runs[1], "metrics.jsonl")
    with open(path, "a") as f:
        f.write(json.dumps(dict(dict(step=5, reward_mean=1.0, step_time_s=3.0, rollout_time_s=2.0, update_time_s=1.0,
                                     ratio_min=0.9, ratio_max=1.1, approx_kl=1e-6, **COUNTS_JAGG),
                                **{field: float("nan")})) + "\n")
    main([*two_runs, "--labels", "vanilla,jagg", "--out", str(tmp_path / "cmp"), "--no_plots"])
    err = capsys.readouterr().err
    assert f"run 'jagg' has non-finite values ({field} at steps [5])" in err, err
    text = (tmp_path / "cmp" / "comparison.json").read_text()
    data = json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c} in comparison.json"))
    assert data["runs"][1]["final_ma_reward"] is None and data["runs"][1]["nonfinite"]


def test_two_runs_in_one_metrics_file_are_warned_about(tmp_path, capsys):
    lines = [json.dumps(dict(step=s, reward_mean=1.0, step_time_s=1.0, run_id=run)) for run in ("a", "b")
             for s in (1, 2)]
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    compare([str(tmp_path / "run")])
    assert "holds steps logged by different runs (run ids ['a', 'b'])" in capsys.readouterr().err
    # a resumed run's segments: other run ids, no shared step: nothing to say
    lines = [json.dumps(dict(step=s, reward_mean=1.0, step_time_s=1.0, run_id=run)) for run, s in
             (("a", 1), ("a", 2), ("b", 3))]
    (tmp_path / "run" / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    compare([str(tmp_path / "run")])
    assert "different runs" not in capsys.readouterr().err
