"""Tiny preset end to end: vanilla and JAGG learn, clearly above the shuffled-advantage control.

Window 4 with jagg_frac 0.6: S=8 and timestep_fraction 0.6 train 4 transitions per sample,
so the plan is ONE group of 4, and round_half_up(1 * 0.6) = 1 routes it to JAGG: every
sample's whole update is JAGG (2 backwards instead of 4), the strongest test of the method.
"""
import json
import os
import subprocess
import sys

import pytest
from helpers import REPO_ROOT

ROOT = REPO_ROOT
STEPS = 45  # the tiny preset runs 30; take-off came at steps 5-15 depending on the seed


def gain_in_stds(output_dir):
    """(mean reward of the last 5 steps - step 1's) / step 1's reward std."""
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert len(records) == STEPS
    last = sum(r["reward_mean"] for r in records[-5:]) / 5
    return (last - records[0]["reward_mean"]) / records[0]["reward_std"], records


SEEDS = (42, 43)  # one seed's 30-step vanilla gain ranged +6 to +25 stds over seeds 1-4, 42, 43


def launch(cache_dir, output_dir, seed, *extra, jagg=True):
    cmd = [sys.executable, "-m", "jagg_patch", "dancegrpo.train_grpo_flux"] if jagg else \
        [sys.executable, "-m", "dancegrpo.train_grpo_flux"]
    cmd += ["--preset", "tiny", "--cache_dir", cache_dir, "--output_dir", str(output_dir),
            "--max_train_steps", str(STEPS), "--seed", str(seed), *extra]
    if jagg:
        # The paper's form, pinned: on this chaotic preset (Adam at lr 1e-2, 45 steps) float rounding
        # alone moves the trajectory. The split backward's gradient equals the joint one to 1.2e-7
        # here, yet gave a mean gain of 6.1 instead of 17.1 stds over seeds 42/43. Every form's
        # gradient is tested against the joint one and float64 references elsewhere.
        cmd += ["--jagg_window", "4", "--jagg_frac", "0.6", "--jagg_backward", "joint", "--jagg_reuse_rollout", "off"]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def train(cache_dir, output_dir, *extra, jagg=True):
    """Mean gain over SEEDS (the seeds' runs side by side, one core each) and every run's records."""
    procs = [(launch(cache_dir, f"{output_dir}-{seed}", seed, *extra, jagg=jagg), f"{output_dir}-{seed}")
             for seed in SEEDS]
    gains, records = [], []
    for proc, out in procs:
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        gain, recs = gain_in_stds(out)
        gains.append(gain)
        records += recs
    return sum(gains) / len(gains), records


@pytest.mark.slow
def test_tiny_jagg_learns_like_vanilla_and_beats_control(cache_dir, tmp_path):
    vanilla, _ = train(cache_dir, tmp_path / "vanilla", jagg=False)
    jagg, records = train(cache_dir, tmp_path / "jagg")
    control, _ = train(cache_dir, tmp_path / "control", "--shuffle_advantages")
    print(f"gain in initial reward stds over {STEPS} steps, mean of seeds {SEEDS}: vanilla {vanilla:+.1f}, "
          f"JAGG {jagg:+.1f}, JAGG shuffled-advantage control {control:+.1f}")
    assert all(r["jagg_groups"] == r["samples"] and r["transformer_backwards"] == 2 * r["samples"] for r in records)
    assert vanilla > 5.0 and vanilla > control + 5.0  # vanilla DanceGRPO learns
    assert jagg > 5.0 and jagg > control + 5.0
    assert jagg > 0.4 * vanilla                    # learns like vanilla, not just "a bit"
