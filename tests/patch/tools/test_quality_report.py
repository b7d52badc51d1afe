"""jagg_patch.tools.quality_report on a synthetic seed tree: means, sample sds, bands and the change
from base equal hand-computed values; the plot is written; incomplete trees are refused."""
import json
import os
import subprocess
import sys

import pytest

from jagg_patch.tools.compare import CompareError
from jagg_patch.tools.quality_report import collect, curves, report

# seed -> variant -> (training rewards per step, held-out at steps 2 and 4); base@0 per seed.
RUNS = {
    1: {"vanilla": ([0.1, 0.3, 0.5, 0.7], [0.6, 0.8]), "jagg": ([0.2, 0.2, 0.4, 0.6], [0.5, 0.7])},
    2: {"vanilla": ([0.3, 0.3, 0.3, 0.9], [0.7, 1.0]), "jagg": ([0.0, 0.4, 0.4, 0.4], [0.6, 0.9])},
}
BASE = {1: 0.5, 2: 0.4}


def write_tree(root, runs=RUNS, base=BASE):
    for seed, variants in runs.items():
        folder = root / f"seed{seed}"
        summaries = [dict(label="base@0", metrics={"digit_heldout": {"mean": base[seed]}, "digit": {"mean": 0.0}})]
        for variant, (rewards, held) in variants.items():
            os.makedirs(folder / variant)
            with open(folder / variant / "metrics.jsonl", "w") as f:
                for i, r in enumerate(rewards, 1):
                    f.write(json.dumps(dict(step=i, reward_mean=r, update_time_s=float(i), step_time_s=2.0 * i,
                                            transformer_backwards=5 if variant == "jagg" else 9)) + "\n")
            summaries += [dict(label=f"{variant}@{step}", metrics={"digit_heldout": {"mean": h}, "digit": {"mean": 0.0}})
                          for step, h in zip((2, 4), held)]
        os.makedirs(folder / "eval")
        with open(folder / "eval" / "comparison.json", "w") as f:
            json.dump(summaries, f)
    return root


def test_table_numbers_equal_hand_computed_ones(tmp_path):
    rows, text = report(str(write_tree(tmp_path / "q")), ma_window=2, out=str(tmp_path / "out"))
    by = {r["variant"]: r for r in rows}
    assert [r["variant"] for r in rows] == ["vanilla", "jagg"]                 # reference first
    v = by["vanilla"]
    assert v["per_seed"] == {1: 0.8, 2: 1.0} and v["final_step"] == 4
    assert v["final_mean"] == pytest.approx(0.9)
    assert v["final_sd"] == pytest.approx(((0.1 ** 2 + 0.1 ** 2) / 1) ** 0.5)  # sample sd, n - 1 = 1
    assert v["change_from_base"] == pytest.approx(0.9 - 0.45)
    # MA(2) of the last two rewards: seed 1 (0.5 + 0.7) / 2 = 0.6, seed 2 (0.3 + 0.9) / 2 = 0.6.
    assert v["final_ma_reward"]["mean"] == pytest.approx(0.6) and v["final_ma_reward"]["sd"] == pytest.approx(0.0)
    assert v["update_time_s"] == 3.0 and by["jagg"]["backwards_per_step"] == 5  # median of steps 2..4
    assert by["jagg"]["final_mean"] == pytest.approx(0.8)
    assert "| vanilla | 0.800 / 1.000 | 0.900 ± 0.141 | +0.450 |" in text
    assert os.path.getsize(tmp_path / "out" / "curves.png") > 1000
    assert json.load(open(tmp_path / "out" / "report.json"))["rows"][0]["variant"] == "vanilla"


def test_variants_choose_and_order_the_rows(tmp_path):
    rows, _ = report(str(write_tree(tmp_path / "q")), variants=["jagg", "vanilla"])
    assert [r["variant"] for r in rows] == ["jagg", "vanilla"]


def test_curves_start_at_base_and_band_over_seeds(tmp_path):
    data = collect(str(write_tree(tmp_path / "q")), "digit_heldout", ma_window=1)
    train, held = curves(data)
    assert held["jagg"]["steps"] == [0, 2, 4]
    assert held["jagg"]["mean"] == pytest.approx([0.45, 0.55, 0.8])
    assert held["jagg"]["low"] == pytest.approx([0.4, 0.5, 0.7]) and held["jagg"]["high"] == pytest.approx([0.5, 0.6, 0.9])
    assert train["vanilla"]["steps"] == [1, 2, 3, 4]
    assert train["vanilla"]["mean"] == pytest.approx([0.2, 0.3, 0.4, 0.8])


def test_incomplete_trees_are_refused_naming_the_folder(tmp_path):
    root = write_tree(tmp_path / "q")
    os.remove(root / "seed2" / "eval" / "comparison.json")
    with pytest.raises(CompareError, match="seed2/eval/comparison.json"):
        report(str(root))
    with pytest.raises(CompareError, match="no seed<S>/ folders"):
        report(str(tmp_path))
    only_vanilla = {s: {"vanilla": v["vanilla"]} for s, v in RUNS.items()}
    root2 = write_tree(tmp_path / "q2", {1: RUNS[1], 2: only_vanilla[2]})
    with pytest.raises(CompareError, match="does not exist"):
        report(str(root2))
    proc = subprocess.run([sys.executable, "-m", "jagg_patch.tools.quality_report", str(root2)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("error:") and "Traceback" not in proc.stderr


def test_a_cut_off_evaluation_or_an_unwritable_out_is_one_line(tmp_path, capsys):
    """As compare and tradeoff: bad input one line, exit 2 (a comparison.json cut off mid-write); an --out
    that cannot be written one line, exit 2; the report's files are written whole."""
    from jagg_patch.tools.quality_report import main
    root = write_tree(tmp_path / "q")
    (tmp_path / "a_file").write_text("in the way")
    for argv, said in [([str(root), "--out", str(tmp_path / "a_file" / "out")], "error: cannot write under --out"),
                       ([str(root)], "is not valid JSON")]:
        if said == "is not valid JSON":
            text = (root / "seed1" / "eval" / "comparison.json").read_text()
            (root / "seed1" / "eval" / "comparison.json").write_text(text[:len(text) // 2])
        with pytest.raises(SystemExit) as stop:
            main(argv)
        err = capsys.readouterr().err.strip()
        assert stop.value.code == 2 and len(err.splitlines()) == 1 and said in err, err
