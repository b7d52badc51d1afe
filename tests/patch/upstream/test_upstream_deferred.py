"""jagg_patch.upstream running the file's own train_one_step, unedited (jagg_patch.upstream.own_step):
--jagg_deferred and every train_one_step that is no release the restated step is written for run it
with the transformer behind the deferred proxy; --jagg_mode exact runs it untouched.
- On every trainer the restated step knows, the deferred gradient is the restated one (float64, 1e-12).
- A train_one_step with one line edited trains as the edited file does: exact == its own loop, JAGG ==
  the independent reference built on the edited file.
- A release whose parameter names are not known (the 93ec253 HunyuanVideo trainer's 26) runs deferred,
  its model and optimizer found by their types.
- The launcher end to end: --jagg_deferred's records.
"""
import os
import subprocess
import sys

import pytest
import torch

from helpers import REPO_ROOT, read_jsonl
from jagg_patch.upstream import apply, revert
from upstream_harness import (B, GA, Standin, in_tmp, one_rank_group, reference_video_gradient, rel,  # noqa: F401
                              standin_file, standins_known, video_advantages, video_jagg_step, video_rollout,
                              video_selection_and_draw, write_changed)


def step_under(standin, **settings):
    """(returns, gradients at each optimizer step, the step's record, what ran) of one step under apply."""
    apply(standin.module, **settings)
    try:
        out, grads, _, _ = standin.step()
        replacement = standin.module.train_one_step
        return out, grads, replacement.last_stats, replacement.jagg_update
    finally:
        revert(standin.module)


# key, its flags, the JAGG settings (both alpha rules, reuse off / on, W 3 / 4, jagg_frac 0.6 / 1)
CASES = [("flux", (), dict(window=4, jagg_frac=1.0, reuse="off")),
         ("flux_lora", (), dict(window=3, jagg_frac=0.6, alpha="index")),
         ("qwenimage", (), dict(window=4, jagg_frac=1.0)),
         ("qwenimage_edit", (), dict(window=3, jagg_frac=1.0, alpha="index", reuse="off")),
         ("hunyuan", ("--bestofn", 2, "--mq_coef", 0.5), dict(window=4, jagg_frac=1.0)),
         ("skyreels", ("--cfg_infer", 3.0), dict(window=3, jagg_frac=1.0, alpha="index"))]


@pytest.mark.parametrize("key, flags, settings", CASES, ids=[c[0] for c in CASES])
def test_deferred_is_the_restated_step(key, flags, settings, cache_dir, tmp_path):
    """Two optimizer steps (GA 2), the file's own draws: the gradient at each step equals the restated
    step's; every row is placed (Wan's and guided SkyReels' calls: two rows a sample)."""
    standin = Standin(key, cache_dir, tmp_path, *flags)
    _, restated, _, update = step_under(standin, **settings, backward="split")
    assert update == "restated"
    _, deferred, record, update = step_under(standin, **settings, deferred=True)
    assert update == "deferred" and record["update"] == "deferred"
    assert len(deferred) == len(restated) >= 1 and max(rel(a, b) for a, b in zip(deferred, restated)) < 1e-12
    assert record["deferred_exact_rows"] == record["deferred_exact/routed_exact"] and record["deferred_jagg_groups"] > 0


def test_wan_samples_of_one_noise_have_their_first_step_placed(cache_dir, tmp_path):
    """Wan's rollout draws one noise per chunk of two samples: their first-step rows (each guided call's
    conditional and unconditional row) have one key, and the flush places them (the samples that train
    their first step are the ones a row short): the gradient is the reference's with every sample's
    transitions in one group, as the restated step groups them, not the one that trains them apart."""
    from upstream_harness import jagg_step_and_its_draw, reference_jagg_gradient
    standin = Standin("wan", cache_dir, tmp_path, "--gradient_accumulation_steps", B)
    grad, record, result, steps = jagg_step_and_its_draw(standin, 4, window=4, jagg_frac=1.0, deferred=True)
    assert record["update"] == "deferred"
    r = result[0].float()
    advantages = (r - r.mean()) / (r.std() + 1e-8)
    reference = reference_jagg_gradient(standin, result, steps, advantages, B * 4)
    # diffusers' Wan sums its time modulation in float32 whatever the weights: a replay in another batch than
    # the call rounds there (measured 1.5e-9; the restated step's batched form 2.2e-9)
    assert rel(grad, reference) < 1e-8
    first = int((steps == 0).any(dim=1).sum())   # the samples that train their first transition
    assert first > 0 and record["deferred_shared_placed"] == 2 * first   # two rows a guided call
    assert record["deferred_exact_rows"] == 0
    apart = reference_jagg_gradient(standin, result, steps, advantages, B * 4, exact_first=True)
    assert rel(grad, apart) > 1e-6


def test_exact_mode_runs_the_files_own_step(cache_dir, tmp_path):
    standin = Standin("flux", cache_dir, tmp_path)
    own, grads, _, _ = standin.step()
    out, exact, record, update = step_under(standin, mode="exact")
    assert update == "own step" and out == own and all(torch.equal(a, b) for a, b in zip(grads, exact))
    n = int(7 * 0.6)
    assert record["transformer_backwards"] == B * n and record["transformer_forwards_nograd"] == B * 8
    assert record["loss"] == out[0] and record["grad_norm"] == out[1]
    lines = open("reward.txt").read().split()
    assert len(lines) == 2 and record["reward_mean"] == float(lines[-1])


def test_an_edited_line_trains_as_the_edited_file(cache_dir, tmp_path, capsys):
    """The HunyuanVideo trainer with its advantage clamp edited from 5.0 to 0.1: no recorded release, so it
    runs its own code, deferred (said once); --jagg_mode exact is the edited file's own loop, and JAGG is
    the reference built on the edited file, not the restated step's 5.0."""
    path = write_changed(tmp_path, "hunyuan", "adv_clip_max = 5.0", "adv_clip_max = 0.1")
    standin = Standin("hunyuan", cache_dir, tmp_path, "--gradient_accumulation_steps", B, path=path)
    own, grads, _, _ = standin.step()
    _, exact, _, update = step_under(standin, mode="exact")
    assert update == "own step" and max(rel(a, b) for a, b in zip(exact, grads)) < 1e-12
    capsys.readouterr()
    (grad,), record, result, rng, _ = video_jagg_step(standin, window=4, jagg_frac=1.0)
    notice = [line for line in capsys.readouterr().out.splitlines() if line.startswith("notice")]
    assert len(notice) == 1 and "no release jagg_patch.upstream knows" in notice[0] and record["update"] == "deferred"
    advantages = video_advantages(standin, video_rollout(standin, result)[0])
    n = int(7 * standin.args.timestep_fraction)
    rows, steps = video_selection_and_draw(standin, advantages, rng, n)
    assert rel(grad, reference_video_gradient(standin, result, rows, steps, advantages, 4, 1.0,
                                              adv_clip_max=0.1)) < 1e-12
    assert rel(grad, reference_video_gradient(standin, result, rows, steps, advantages, 4, 1.0)) > 1e-2


def test_a_release_of_unknown_parameter_names_runs_its_own_step(cache_dir, tmp_path, capsys):
    """train_grpo_hunyuan.py with a 26-parameter train_one_step (93ec253's count; its names are not known
    here): another trainer than the restated one, so it runs as it is, its model and optimizer found by
    their types; the gradient is that of the same code under its known names."""
    extra = ", ".join(f"unused_{i}=None" for i in range(16))
    path = write_changed(tmp_path, "hunyuan",
                         "def train_one_step(args, device, transformer, vae, inferencer, optimizer, lr_scheduler, "
                         "loader, max_grad_norm, step):\n",
                         "def train_one_step(args, device, model, vae, inferencer, opt, lr_scheduler, loader, "
                         f"max_grad_norm, step, {extra}):\n    transformer, optimizer = model, opt\n")
    settings = dict(window=4, jagg_frac=1.0)
    known = Standin("hunyuan", cache_dir, tmp_path / "known")
    _, reference, _, _ = step_under(known, **settings, deferred=True)
    standin = Standin("hunyuan", cache_dir, tmp_path, path=path)
    capsys.readouterr()
    assert apply(standin.module, **settings) is None   # no family the restated step is written for
    revert(standin.module)
    assert "the HunyuanVideo trainer of 93ec253" in capsys.readouterr().out
    _, grads, record, update = step_under(standin, **settings)
    assert update == "deferred" and max(rel(a, b) for a, b in zip(grads, reference)) < 1e-12


@pytest.mark.slow
def test_the_launcher_runs_the_files_own_step_deferred(cache_dir, tmp_path):
    """`python -m jagg_patch.upstream --jagg_deferred` on the Flux stand-in (a known release: the flag
    chooses), two steps: upstream's own loop and reward file, the proxy's counts in jagg_metrics.jsonl."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO_ROOT)
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tests", "upstream_launch.py"), "--jagg_deferred",
                          "--jagg_window", "4", "--jagg_frac", "1", standin_file("flux"), "--cache_dir", cache_dir,
                          "--output_dir", out, "--use_group", "--num_generations", str(B),
                          "--gradient_accumulation_steps", str(GA), "--max_train_steps", "2"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "deferred (jagg_patch.deferred, the trainer's update unpatched)" in run.stdout and "step 2 loss" in run.stdout
    records = read_jsonl(out / "jagg_metrics.jsonl")
    rewards = [float(x) for x in (tmp_path / "reward.txt").read_text().split()]
    assert [r["update"] for r in records] == ["deferred"] * 2 and [r["reward_mean"] for r in records] == rewards
    assert all(r["deferred_jagg_groups"] == B and r["transformer_backwards"] == 2 * B for r in records)


def test_the_notice_of_an_unknown_release_is_said_once(cache_dir, tmp_path, capsys):
    """The launcher applies again when its preflight narrows a setting (the window, the monitor's
    samples): the notice that the file runs its own step is said at the first apply only."""
    path = write_changed(tmp_path, "hunyuan", "adv_clip_max = 5.0", "adv_clip_max = 0.1")
    standin = Standin("hunyuan", cache_dir, tmp_path, path=path)
    capsys.readouterr()
    try:
        apply(standin.module, window=4, jagg_frac=1.0)
        apply(standin.module, window=3, jagg_frac=1.0)
    finally:
        revert(standin.module)
    said = [line for line in capsys.readouterr().out.splitlines() if "no release jagg_patch.upstream knows" in line]
    assert len(said) == 1


class Stepper:
    """An optimizer of the loop's own making (no torch optimizer, holding none as .optimizer)."""

    def __init__(self, inner):
        self._inner = inner

    def step(self):
        self._inner.step()

    def zero_grad(self, set_to_none=True):
        self._inner.zero_grad(set_to_none=set_to_none)


def test_exact_mode_runs_the_files_own_step_with_an_optimizer_of_any_kind(cache_dir, tmp_path):
    """--jagg_mode exact leaves the step as it is and hooks no optimizer: one that is no torch optimizer
    runs as without the adapter, weights for weights."""
    standin = Standin("flux", cache_dir, tmp_path)

    def weights_after():
        torch.manual_seed(7)
        standin.transformer.load_state_dict(standin.initial)
        standin.transformer.zero_grad(set_to_none=True)
        optimizer = torch.optim.AdamW(standin.trainable(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        standin.module.train_one_step(*standin.arguments(Stepper(optimizer), scheduler))
        return torch.cat([p.detach().reshape(-1).clone() for p in standin.trainable()])

    weights_before = torch.cat([p.detach().reshape(-1).clone() for p in standin.trainable()])
    own = weights_after()
    apply(standin.module, mode="exact")
    try:
        exact = weights_after()
    finally:
        revert(standin.module)
    assert torch.equal(own, exact) and not torch.equal(own, weights_before)


def test_a_file_without_a_main_block_is_one_line(tmp_path, capsys):
    from jagg_patch.upstream.__main__ import main
    path = write_changed(tmp_path, "flux", 'if __name__ == "__main__":', "def not_a_main_block():")
    with pytest.raises(SystemExit) as stop:
        main(["--jagg_window", "3", path, "--use_group"])
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and len(err.splitlines()) == 1 and 'has no `if __name__ == "__main__":` block' in err


@pytest.mark.parametrize("key", ["hunyuan", "skyreels"])
def test_a_video_trainer_without_videoalign_is_refused_before_its_rollout(key, cache_dir, tmp_path, capsys):
    """Upstream's video trainers append a reward only with --use_videoalign: without it their rollout ends
    in torch.cat of an empty list, so the preflight says so first."""
    import copy
    from jagg_patch.upstream.__main__ import jagg_parser, preflight
    standin = Standin(key, cache_dir, tmp_path, *(["--cfg_infer", "3.0"] if key == "skyreels" else []))
    args = copy.copy(standin.args)
    args.use_videoalign = False
    with pytest.raises(SystemExit) as stop:
        preflight(args, jagg_parser().parse_args([]), {"skyreels": "skyreels_i2v"}.get(key, key))
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and len(err.splitlines()) == 1 and "add --use_videoalign" in err
