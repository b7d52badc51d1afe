"""`python -m jagg_patch` single-process and under torchrun, and FSDP1 joint backward."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST = ["--train_batch_size", "2", "--num_generations", "4", "--gradient_accumulation_steps", "8",
        "--sample_batch_size", "8", "--update_batch_size", "4"]


def run(cmd, timeout=240):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def torchrun(*args):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *args]


def metrics(output_dir):
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_help_explains_usage():
    out = run([sys.executable, "-m", "jagg_patch", "--help"])
    assert out.returncode == 0
    assert "python -m jagg_patch TRAINER_MODULE" in out.stdout and "--jagg_window" in out.stdout


@pytest.mark.parametrize("flag, value, message", [
    ("--jagg_window", "1", "must be >= 2"), ("--jagg_frac", "1.5", "must be in [0, 1]"),
    ("--jagg_mode", "fast", "invalid choice"),
])
def test_bad_jagg_flags_are_argparse_errors(cache_dir, tmp_path, flag, value, message):
    out = run([sys.executable, "-m", "jagg_patch", "dancegrpo.train_grpo_flux", "--preset", "tiny",
               "--cache_dir", cache_dir, "--output_dir", str(tmp_path), flag, value])
    assert out.returncode == 2 and message in out.stderr and flag in out.stderr


def test_unknown_trainer_module_is_an_error():
    out = run([sys.executable, "-m", "jagg_patch", "no_such.trainer"])
    assert out.returncode == 2 and "cannot import trainer module" in out.stderr


def test_launch_tiny_prints_plan_and_saves_backwards(cache_dir, tmp_path):
    out = run([sys.executable, "-m", "jagg_patch", "dancegrpo.train_grpo_flux", "--preset", "tiny",
               "--cache_dir", cache_dir, "--output_dir", str(tmp_path), "--max_train_steps", "1", *FAST,
               "--jagg_window", "3", "--jagg_frac", "0.6"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert "JAGG plan (mode jagg, window 3, jagg_frac 0.6)" in out.stdout
    assert "group 0: positions [0, 1, 2] (size 3) -> JAGG" in out.stdout
    assert "group 1: positions [3] (size 1) -> exact" in out.stdout
    (record,) = metrics(tmp_path)
    assert (record["jagg_groups"], record["exact_groups"]) == (8, 8)
    assert record["transformer_backwards"] == 8 * (2 + 1)  # vanilla: 8 * 4


def test_fsdp_joint_backward_equals_single_process():
    out = run(torchrun(os.path.join("tests", "dist", "fsdp_jagg_check.py")))
    assert out.returncode == 0 and "FSDP_JAGG_OK" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]


def test_launch_under_torchrun(cache_dir, tmp_path):
    out = run(torchrun("-m", "jagg_patch", "dancegrpo.train_grpo_flux", "--preset", "tiny", "--cache_dir",
                       cache_dir, "--output_dir", str(tmp_path), "--max_train_steps", "1", *FAST,
                       "--jagg_window", "4"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("JAGG plan") == 1  # printed by rank 0 only
    (record,) = metrics(tmp_path)
    assert record["world_size"] == 2 and record["samples"] == 16
    assert (record["jagg_groups"], record["transformer_backwards"]) == (16, 2 * 16)
