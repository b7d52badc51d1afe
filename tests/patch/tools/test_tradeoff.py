"""jagg_patch.tools.tradeoff on a synthetic quality tree and hand-written bench JSONs: the ratios are
the bench's whole steps over vanilla's (auto at its cadence), the routing history is read from the
records' bitmask, the verdicts follow the tolerance by hand; missing pieces are refused by name."""
import json
import os

import pytest

from jagg_patch.tools.compare import CompareError
from jagg_patch.tools.quality_report import report
from jagg_patch.tools.tradeoff import main, routing_history, tradeoff

# seed -> variant -> held-out at the last step (4); the training records are 4 steps.
HELD = {1: {"vanilla": 0.80, "jagg": 0.78, "jagg_w8": 0.60, "jagg_auto": 0.79},
        2: {"vanilla": 0.90, "jagg": 0.86, "jagg_w8": 0.62, "jagg_auto": 0.85}}
# jagg_auto's routing bitmask per step (seed 2 changes at step 3; seed 1 never does)
ROUTED = {1: [0b011, 0b011, 0b011, 0b011], 2: [0b011, 0b011, 0b001, 0b001]}


def write_tree(root):
    for seed, variants in HELD.items():
        folder = root / f"seed{seed}"
        summaries = [dict(label="base@0", metrics={"digit_heldout": {"mean": 0.5}})]
        for variant, held in variants.items():
            os.makedirs(folder / variant)
            with open(folder / variant / "metrics.jsonl", "w") as f:
                for step in range(1, 5):
                    record = dict(step=step, reward_mean=0.5, update_time_s=1.0, step_time_s=2.0,
                                  transformer_backwards={"vanilla": 9, "jagg": 5}.get(variant, 3))
                    if variant == "jagg_auto":
                        record["jagg_routed"] = ROUTED[seed][step - 1]
                        if step in (1, 3):   # the monitor measures at steps 1 and 3
                            record.update({"jagg_cos/g0": 0.9 + 0.01 * step + 0.001 * seed, "jagg_cos/g1": float("nan")})
                    f.write(json.dumps(record) + "\n")
            summaries.append(dict(label=f"{variant}@4", metrics={"digit_heldout": {"mean": held}}))
        os.makedirs(folder / "eval")
        with open(folder / "eval" / "comparison.json", "w") as f:
            json.dump(summaries, f)
    report(str(root), out=str(root / "report"))
    return root


def write_bench(path, mode, mode_numbers, vanilla_step=4.0, reps=None):
    bench = {"modes": {"vanilla": {"step_s": vanilla_step}, mode: mode_numbers}}
    if reps:   # the timed update repetitions: {mode: [s, ...], "vanilla": [s, ...]}
        bench["update_times_s"] = reps
    with open(path, "w") as f:
        json.dump(bench, f)
    return str(path)


@pytest.fixture
def tree(tmp_path):
    root = write_tree(tmp_path / "quality")
    benches = {"jagg": (write_bench(tmp_path / "j.json", "jagg_split_reuse", {"step_s": 3.0}), "jagg_split_reuse"),
               "jagg_w8": (write_bench(tmp_path / "w8.json", "jagg_split_reuse", {"step_s": 2.0}), "jagg_split_reuse"),
               # auto: its full timed step is 3.6 s, at its cadence 2.8 s: the cadence is the ratio
               "jagg_auto": (write_bench(tmp_path / "a.json", "jagg_split_reuse_auto",
                                         {"step_s": 3.6, "cadence_step_s": 2.8}), "jagg_split_reuse_auto")}
    return root, benches


def test_rows_ratios_and_routing(tree):
    root, benches = tree
    rows, verdict, text = tradeoff(str(root), benches)
    by = {r["variant"]: r for r in rows}
    assert by["vanilla"]["step_ratio"] == 1.0
    assert by["jagg"]["step_ratio"] == pytest.approx(3.0 / 4.0)
    assert by["jagg_w8"]["step_ratio"] == pytest.approx(2.0 / 4.0)
    assert by["jagg_auto"]["step_ratio"] == pytest.approx(2.8 / 4.0)
    assert by["jagg"]["mean"] == pytest.approx(0.82) and by["jagg"]["sd"] == pytest.approx(0.0565685, rel=1e-5)
    assert by["jagg"]["backwards_per_step"] == 5
    assert by["jagg_auto"]["routing_per_seed"] == {1: [(1, [0, 1])], 2: [(1, [0, 1]), (3, [0])]}
    assert by["jagg_auto"]["routing"] == "seed 1: step 1: [0, 1] | seed 2: step 1: [0, 1]; step 3: [0]"
    assert by["jagg"]["routing"] == "" and by["jagg"]["measured_cos"] == ""
    # g0 measured 0.911, 0.931 (seed 1), 0.912, 0.932 (seed 2); g1 only NaN: not shown
    assert by["jagg_auto"]["measured_cos"] == "g0 0.911-0.932"
    # vanilla 0.85 ± 0.0707: the floor is 0.779; w8 (0.61) is below it, jagg (0.82, 0.75) and auto
    # (0.82, 0.70) are above: auto is the fastest at equal quality and beats jagg, the one fixed W 4 row.
    assert verdict["floor"] == pytest.approx(0.85 - 0.0707107, rel=1e-5)
    assert verdict["fastest_equal"] == "jagg_auto" and not verdict["goal_met"]
    assert verdict["auto"]["jagg_auto"] == dict(window=4, equal_quality=True, beats_every_fixed=True,
                                                slower_than=[], fixed_compared=["jagg"])
    assert verdict["fastest_tied"] == [] and by["jagg"]["step_spread"] == 0.0   # no repetitions recorded
    assert "**jagg_auto**, 0.70 of vanilla's step time" in text and "NOT met" in text


def timed(tmp_path, name, mode, numbers, mode_reps):
    return write_bench(tmp_path / name, mode, numbers, reps={mode: mode_reps, "vanilla": [2.0, 2.2, 2.1]}), mode


def test_a_step_counts_faster_only_beyond_both_benches_spread(tree, tmp_path):
    """jagg 0.75 with spread (0.1 + 0.1) / 4 = 0.05; auto 0.70 with (0.22 + 0.1) / 4 = 0.08: the
    intervals overlap, so auto neither beats jagg nor loses to it, and jagg ties the fastest."""
    root, benches = tree
    benches["jagg"] = timed(tmp_path, "j.json", "jagg_split_reuse", {"step_s": 3.0}, [1.0, 1.2, 1.1])
    benches["jagg_auto"] = timed(tmp_path, "a.json", "jagg_split_reuse_auto", {"step_s": 3.6, "cadence_step_s": 2.8},
                                 [1.0, 1.44, 1.2])
    rows, verdict, text = tradeoff(str(root), benches)
    by = {r["variant"]: r for r in rows}
    assert by["jagg"]["step_spread"] == pytest.approx(0.05) and by["jagg_auto"]["step_spread"] == pytest.approx(0.08)
    auto = verdict["auto"]["jagg_auto"]
    assert not auto["beats_every_fixed"] and auto["slower_than"] == []
    assert verdict["fastest_equal"] == "jagg_auto" and verdict["fastest_tied"] == ["jagg"]
    assert "0.70 ± 0.08" in text and "within the benches' spread of jagg" in text
    assert "Within the benches' spread of it: jagg." in text
    # auto at 0.90 with a tight bench (spread 0.025) is slower than jagg beyond both spreads
    benches["jagg_auto"] = timed(tmp_path, "a.json", "jagg_split_reuse_auto", {"step_s": 3.6}, [1.0, 1.0, 1.0])
    _, verdict, text = tradeoff(str(root), benches)
    assert verdict["auto"]["jagg_auto"]["slower_than"] == ["jagg"] and "slower than jagg beyond" in text


def test_a_looser_goal_and_tolerance_change_the_verdicts(tree):
    root, benches = tree
    _, verdict, _ = tradeoff(str(root), benches, tolerance_sd=4.0, goal_ratio=0.5)
    assert verdict["fastest_equal"] == "jagg_w8" and verdict["goal_met"]     # 0.61 >= 0.85 - 4 sd = 0.567


def test_writes_the_table_the_json_and_the_plot(tree, tmp_path):
    root, benches = tree
    argv = [str(root), "--out", str(tmp_path / "out")]
    for variant, (path, mode) in benches.items():
        argv += ["--bench", f"{variant}={path}:{mode}"]
    main(argv)
    for name in ("tradeoff.md", "tradeoff.json", "pareto.png"):
        assert (tmp_path / "out" / name).stat().st_size > 0


def test_refuses_a_variant_without_a_measured_ratio(tree):
    root, benches = tree
    del benches["jagg_w8"]
    with pytest.raises(CompareError, match="no --bench for jagg_w8"):
        tradeoff(str(root), benches)


def test_refuses_a_bench_without_the_mode(tree, tmp_path):
    root, benches = tree
    benches["jagg"] = (benches["jagg"][0], "jagg_batched")
    with pytest.raises(CompareError, match="needs vanilla and 'jagg_batched'"):
        tradeoff(str(root), benches)


def _argv(root, benches, *extra):
    argv = [str(root), *extra]
    for variant, (path, mode) in benches.items():
        argv += ["--bench", f"{variant}={path}:{mode}"]
    return argv


def _one_line_exit(capsys, argv, code=2):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert stop.value.code == code and len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_refuses_a_malformed_bench_argument(tree, capsys):
    root, _ = tree
    assert "expected VARIANT=BENCH_JSON:MODE" in _one_line_exit(capsys, [str(root), "--bench", "jagg=only_a_path.json"])


@pytest.mark.parametrize("content, said", [
    ("", "is not valid JSON (Expecting value at line 1; empty or cut off?)"),
    ('{"modes": {"vanilla": {"step_s": 4.0}, "jagg_spl', "is not valid JSON"),
    ("{}", "is not a bench_update JSON (no 'modes')"),
    ('{"modes": {"vanilla": {"step_s": 0.0}, "jagg_split_reuse": {"step_s": 3.0}}}', "step_s is 0.0, not a positive time"),
    ('{"modes": {"vanilla": {"step_s": 4.0}, "jagg_split_reuse": {}}}', "step_s is None, not a positive time")],
    ids=["empty", "truncated", "no-modes", "zero-time", "untimed"])
def test_a_bad_bench_json_is_one_line_and_exit_2(tree, capsys, content, said):
    root, benches = tree
    with open(benches["jagg"][0], "w") as f:
        f.write(content)
    assert said in _one_line_exit(capsys, _argv(root, benches))


@pytest.mark.parametrize("content", ["", "{}", '{"rows": [1]}'], ids=["empty", "empty-object", "no-variants"])
def test_a_bad_quality_report_is_one_line_and_exit_2(tree, capsys, content):
    root, benches = tree
    (root / "report" / "report.json").write_text(content)
    assert "report.json" in _one_line_exit(capsys, _argv(root, benches))


def test_an_unwritable_out_is_one_line_exit_2_and_a_full_disk_exit_3(tree, tmp_path, capsys, monkeypatch):
    root, benches = tree
    (tmp_path / "a_file").write_text("in the way")
    err = _one_line_exit(capsys, _argv(root, benches, "--out", str(tmp_path / "a_file" / "out")))
    assert err.startswith("error: cannot write under --out") and "a_file" in err
    import errno
    from dancegrpo.utils import atomic

    def full(path, write):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(atomic, "write_atomically", full)
    err = _one_line_exit(capsys, _argv(root, benches, "--out", str(tmp_path / "out")), code=3)
    assert err.startswith("stopped: no space left to write under --out")


def test_routing_history_without_auto_is_empty():
    assert routing_history([dict(step=1), dict(step=2)]) == []
    assert routing_history([dict(step=1, jagg_routed=0), dict(step=2, jagg_routed=4)]) == [(1, []), (2, [2])]
