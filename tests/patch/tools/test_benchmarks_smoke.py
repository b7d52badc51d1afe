"""Smoke test of benchmarks/*.sh at minimal sizes on the tiny preset (not timed): each script runs
end to end and writes its raw numbers and markdown table."""
import json
import os
import subprocess

import pytest
from helpers import REPO_ROOT

pytestmark = pytest.mark.slow

ROOT = REPO_ROOT
# 1 prompt x 2 generations, S = 8 (4 trained transitions: window 4 gives one JAGG group)
SIZE = ("--train_batch_size 1 --num_generations 2 --gradient_accumulation_steps 2 --sample_batch_size 2 "
        "--update_batch_size 2 --h 32 --w 32")


# Each test's script and its settings. The scripts start side by side (one process each at a time,
# most of it imports: 2 cores run two at once), all of the selected ones at the first test's start.
SCRIPTS = {
    "test_speed_script": ("speed.sh", dict(STEPS="2", BENCH_REPS="1", BENCH_UNIT_REPS="1",
                                           VARIANTS="vanilla jagg authors")),  # the micro-benchmark: all modes
    # (window 3 is covered in-process by test_fidelity.py)
    "test_fidelity_script": ("fidelity.sh", dict(WINDOWS="2", ROLLOUTS="2", SAMPLES="2")),
    "test_quality_script": ("quality.sh", dict(STEPS="2", VARIANTS="vanilla jagg control", EVAL_PROMPTS="2",
                                               EVAL_IMAGES="1", SEEDS="7")),
    # Two seeds x two variants x two steps on the shipped digits models (the script sets its own preset)
    "test_digits_script": ("digits.sh", dict(
        SIZE_ARGS="--train_batch_size 1 --num_generations 2 --gradient_accumulation_steps 2 --sample_batch_size 2 "
                  "--update_batch_size 2", SEEDS="1 2", STEPS="2", EVAL_EVERY="1", EVAL_IMAGES="1",
        VARIANTS="vanilla jagg_window", FID_ROLLOUTS="1", FID_SAMPLES="2", FID_GROUPINGS="window", PRESET="")),
    # The one test of the digits_large world: one seed x two variants x one step, its bench and table
    "test_digits_large_script": ("digits_large.sh", dict(
        SIZE_ARGS="--train_batch_size 1 --num_generations 2 --gradient_accumulation_steps 2 --sample_batch_size 2 "
                  "--update_batch_size 2", SEEDS="1", STEPS="1", EVAL_EVERY="1", EVAL_IMAGES="1",
        VARIANTS="vanilla jagg_auto", FID_ROLLOUTS="1", FID_SAMPLES="2", FID_GROUPINGS="window", BENCH_REPS="1",
        BENCH_UNIT_REPS="1", MONITOR_EVERY="1")),
    "test_precision_script": ("precision.sh", dict(WORLDS="tiny", PREC_SAMPLES="2")),
    "test_recipe_speed_script": ("recipe_speed.sh", dict(WORLDS="tiny", CONFIGS="all:1.0", BENCH_REPS="1")),
    "test_flow_grpo_fast_script": ("flow_grpo_fast.sh", dict(BENCH_REPS="1",
                                                             BENCH_MODES="vanilla,jagg_split,jagg_split_reuse")),
}


class SideBySide:
    def __init__(self, names, root, cache_dir):
        self.procs, self.root = {}, root
        for name in names:
            script, env = SCRIPTS[name]
            folder = root / name
            folder.mkdir()
            full = dict(os.environ, PRESET="tiny", MODELS="flux", OUT=str(folder / "out"), CACHE_DIR=cache_dir,
                        SIZE_ARGS=SIZE, S_FLUX="8", OMP_NUM_THREADS="1")
            full.update(env)
            with open(folder / "stdout", "w") as out, open(folder / "stderr", "w") as err:
                self.procs[name] = subprocess.Popen(["bash", os.path.join(ROOT, "benchmarks", script)], env=full,
                                                    cwd=str(folder), stdout=out, stderr=err, text=True)

    def result(self, name):
        """(stdout, output folder) of the test's script, once it has finished."""
        proc, folder = self.procs[name], self.root / name
        proc.wait(timeout=900)
        stdout, stderr = (folder / "stdout").read_text(), (folder / "stderr").read_text()
        assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
        return stdout, folder / "out"

    def stop(self):
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def scripts(request, cache_dir, tmp_path_factory):
    selected = {item.originalname for item in request.session.items if item.module is request.module}
    started = SideBySide(sorted(selected & set(SCRIPTS)), tmp_path_factory.mktemp("benchmarks"), cache_dir)
    yield started
    started.stop()


@pytest.fixture
def script(request, scripts):
    return scripts.result(request.node.originalname)


def test_speed_script(script):
    text, out = script
    assert "# Speed benchmark" in text and "| jagg |" in text and "| endpoints |" in text and "| jagg_split |" in text
    cmp = json.loads((out / "speed/flux/compare/comparison.json").read_text())
    assert [r["label"] for r in cmp["runs"]] == ["vanilla", "jagg", "authors"]
    assert all(r["steps"] == 2 for r in cmp["runs"])
    # one JAGG group of 4 per sample: 2 backwards instead of 4 (2 samples); the authors' variant:
    # windows (0..3), (4, 5, 6), int(2 * 0.6) = 1 trained per sample, each JAGG: 2 backwards
    assert cmp["runs"][0]["backwards_per_step"] == 8 and cmp["runs"][1]["backwards_per_step"] == 4
    assert cmp["runs"][2]["backwards_per_step"] == 4
    assert "grouping window, alpha index, backward split" in (out / "speed/flux/authors.log").read_text()
    for png in ("reward_curves.png", "step_times.png"):
        assert (out / "speed/flux/compare" / png).is_file()
    bench = json.loads((out / "speed/flux/bench_update.json").read_text())
    assert set(bench["modes"]) == {"vanilla", "jagg", "jagg_split", "jagg_batched", "jagg_reuse", "jagg_split_reuse",
                                   "jagg_batched_reuse", "exact", "endpoints"}
    assert bench["headline"] == "jagg_split_reuse"   # auto on one process, reuse on_policy
    peaks = bench["activation_peak_mb"]
    assert 0 < peaks["jagg_split"] < peaks["jagg"]   # one endpoint graph alive instead of two
    authors = bench["predicted_update_s_authors_schedule"]
    assert authors["jagg"] > bench["modes"]["jagg"]["predicted_update_s"]   # 2 more no-grad forwards per group
    assert bench["train_transitions"] == 4 and bench["plan"] == [dict(size=4, jagg=True)]
    assert "predicted_update_gain" in bench and "Checks on jagg_split_reuse" in (out / "speed/flux/bench_update.md").read_text()
    assert (out / "speed/speed.md").is_file()


def test_fidelity_script(script):
    text, out = script
    assert text.count("## Gradient fidelity") == 1
    for w in (2,):
        res = json.loads((out / f"fidelity/flux/w{w}/fidelity.json").read_text())
        assert res["rollouts"] == 2 and res["window"] == w
        for g in res["groups"]:
            assert -1.0 <= g["cos_jagg_mean"] <= 1.0
            if w == 2:
                assert g["cos_jagg_min"] == pytest.approx(1.0, abs=1e-6)
        assert (out / f"fidelity/flux/w{w}/fidelity.csv").is_file()


def test_quality_script(script):
    text, out = script
    base = out / "quality/flux/seed7"
    cmp = json.loads((base / "compare/comparison.json").read_text())
    assert [r["label"] for r in cmp["runs"]] == ["vanilla", "jagg", "control"]
    # the control is vanilla with permuted advantages (the launch line is in each run's log)
    assert "--shuffle_advantages" in (base / "control.log").read_text()
    assert "--shuffle_advantages" not in (base / "vanilla.log").read_text()
    assert (base / "compare/reward_curves.png").is_file()
    assert (base / "eval/table.md").is_file() and (base / "eval/comparison.json").is_file()
    assert "evaluation of the step-2 checkpoints" in text and "vanilla" in (base / "eval/table.md").read_text()


def test_digits_script(script):
    """Two seeds x two variants x two steps on the shipped digits models, every checkpoint evaluated,
    the seed report and one fidelity table written."""
    text, out = script
    assert "## Quality, flux" in text and "## Fidelity, grouping window" in text
    report = json.loads((out / "digits/quality/flux/report/report.json").read_text())
    assert [r["variant"] for r in report["rows"]] == ["vanilla", "jagg_window"]
    assert report["eval_curves"]["vanilla"]["steps"] == [0, 1, 2]      # base@0, then every checkpoint
    # vanilla: 4 trained transitions x 2 samples; jagg_window trains one window per sample, JAGG (2
    # backwards) where jagg_frac routes it, exact (3) in the low-noise window (4, 5, 6)
    assert report["rows"][0]["backwards_per_step"] == 8 and report["rows"][1]["backwards_per_step"] in (4, 5, 6)
    assert "grouping window" in (out / "digits/quality/flux/seed1/jagg_window.log").read_text()
    assert (out / "digits/quality/flux/report/curves.png").is_file()
    fid = json.loads((out / "digits/fidelity_window/fidelity/flux/w4/fidelity.json").read_text())
    assert fid["grouping"] == "window" and fid["rollouts"] == 1


def test_digits_large_script(script):
    """benchmarks/digits_large.sh on the shipped digits_large models: the runs at the preset's own
    geometry (upstream's S 16), the bench of auto side by side with vanilla, and the table joining
    them (auto's ratio at the runs' cadence, its routing read from the runs)."""
    text, out = script
    root = out / "digits_large"
    assert "# How to use JAGG in the digits_large world" in text and "## flux" in text
    assert "digits_large" in (root / "quality/flux/seed1/vanilla.log").read_text()
    (record,) = [json.loads(line) for line in (root / "quality/flux/seed1/vanilla/metrics.jsonl").read_text().splitlines()]
    assert record["train_timesteps"] == 9     # S 16, fraction 0.6: 9 of 15 transitions
    bench = json.loads((root / "speed/flux/jagg_auto.json").read_text())
    assert set(bench["modes"]) == {"vanilla", "jagg_split_reuse_auto"} and bench["monitor_every"] == 1
    table = json.loads((root / "tradeoff/flux/tradeoff.json").read_text())
    rows = {r["variant"]: r for r in table["rows"]}
    auto = bench["modes"]["jagg_split_reuse_auto"]
    assert rows["vanilla"]["step_ratio"] == 1.0
    assert rows["jagg_auto"]["step_ratio"] == pytest.approx(auto["cadence_step_s"] / bench["modes"]["vanilla"]["step_s"])
    assert rows["jagg_auto"]["routing"].startswith("step 1: ")   # measured at step 1 (every step here)
    assert (root / "tradeoff/flux/pareto.png").is_file()


def test_gpu_check_refuses_at_once_without_cuda(tmp_path):
    """benchmarks/gpu_check.sh is for a CUDA machine; here (no GPU) it must stop before any work."""
    import time
    start = time.time()
    proc = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_check.sh")], cwd=str(tmp_path),
                          env=dict(os.environ, OUT=str(tmp_path / "out")), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3 and "no CUDA device" in proc.stderr and "nothing was run" in proc.stderr
    assert not (tmp_path / "out").exists() and time.time() - start < 60


def test_flow_grpo_fast_script(script):
    """benchmarks/flow_grpo_fast.sh: the Flux Flow-GRPO-Fast recipe (6 steps, window 3 in (0, 3), cps)
    through the train script into the micro-benchmark; the window's 3 transitions are one JAGG group."""
    text, out = script
    assert "# Flow-GRPO-Fast + JAGG (window K=3)" in text and "the paper's Flow-GRPO-Fast figure" in text
    bench = json.loads((out / "flow_grpo_fast/flux/bench_update.json").read_text())
    assert bench["sampling_steps"] == 6 and bench["sde_window_size"] == 3 and bench["train_transitions"] == 3
    assert bench["plan"] == [dict(size=3, jagg=True)] and bench["headline"] == "jagg_split_reuse"
    assert set(bench["modes"]) == {"vanilla", "jagg_split", "jagg_split_reuse"}


def test_precision_script(script):
    """benchmarks/precision.sh: the three measurements of one world and family, their report."""
    text, out = script
    assert "# What bf16 does to JAGG" in text and text.count("### tiny, flux: ") == 3
    folder = out / "precision/tiny/flux"
    assert json.loads((folder / "f32_mb1.json").read_text())["update_batch_size"] == 1
    bf16 = json.loads((folder / "bf16.json").read_text())
    assert bf16["precision"] == "bf16" and bf16["gradient"]["samples"] == 2
    assert json.loads((folder / "bf16_rescored_f32.json").read_text())["update_precision"] == "no"


def test_recipe_speed_script(script):
    """benchmarks/recipe_speed.sh: one configuration timed with and without gradient checkpointing (one
    group per sample: W = the 4 trained transitions), its rows in the table."""
    text, out = script
    folder = out / "recipe_speed/tiny/flux"
    plain, ckpt = (json.loads((folder / f"4_1.0_{kind}.json").read_text()) for kind in ("plain", "ckpt"))
    assert (plain["checkpointing"], ckpt["checkpointing"]) == (0.0, 1.0) and plain["window"] == 4
    assert set(ckpt["modes"]) == {"vanilla", "jagg_split_reuse", "jagg_batched_reuse"}
    assert "| tiny | flux | 4 | 1 | split |" in text and "| tiny | flux | 4 | 1 | batched |" in text
