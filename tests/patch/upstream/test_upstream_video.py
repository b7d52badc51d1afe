"""jagg_patch.upstream on upstream's video trainers, HunyuanVideo and SkyReels-I2V (stand-ins on a tiny
video model with fastvideo's HunyuanVideo call, float64, one rank): exact mode == each stand-in's own
train_one_step (the gradient at every optimizer step, its returns, the global RNG, the reward files),
with best-of-n of even and odd n, n == num_generations and n above the batch, both rewards weighed,
with and without --use_group, guided and not; JAGG == an independent float64 reference built from each
stand-in's own grpo_one_step; the counts; the refusals before the rollout; the launcher's plan; an
end-to-end run through `python -m jagg_patch.upstream` read by compare."""
import json
import os
import subprocess
import sys

import pytest
import torch

from jagg_patch.upstream import apply, revert
from upstream_harness import (B, STANDIN, Standin, in_tmp, one_rank_group, standins_known, recorded_rollout,  # noqa: F401
                              reference_video_gradient, rel, standin_setup, video_advantages, video_jagg_step, video_rollout,
                              video_selection_and_draw)
from upstream_releases import write_release

from helpers import REPO_ROOT

pytestmark = pytest.mark.filterwarnings("ignore::jagg_patch.upstream.UpstreamSourceChanged")
S = 8   # sampling steps: 7 trainable transitions


def reward_lines():
    return {name: open(name).read().splitlines() for name in ("reward.txt", "vq_reward.txt", "mq_reward.txt")
            if os.path.exists(name)}


EXACT = [("hunyuan", (), True), ("hunyuan", ("--bestofn", 3, "--mq_coef", 0.5), True),
         ("hunyuan", ("--bestofn", 2, "--vq_coef", 0.3, "--mq_coef", 1.0), True),
         ("hunyuan", ("--bestofn", 6), True), ("hunyuan", ("--bestofn", 2), False),
         ("skyreels", (), True), ("skyreels", ("--cfg_infer", 3.0), True), ("skyreels", ("--cfg_infer", 3.0), False)]


@pytest.mark.parametrize("key, flags, grouped", EXACT,
                         ids=["hunyuan-n=G", "hunyuan-odd-n-mq", "hunyuan-even-n", "hunyuan-n-over-batch",
                              "hunyuan-nogroup", "skyreels-cfg1", "skyreels-cfg3", "skyreels-cfg3-nogroup"])
def test_exact_mode_is_the_stand_ins_own_step(key, flags, grouped, cache_dir, tmp_path):
    """GA 2: with best-of-n 3 the third sample's gradient is never stepped (upstream's), with 6 of a batch of
    4 the top and the bottom overlap and two samples train twice."""
    standin = Standin(key, cache_dir, tmp_path, *flags, group=grouped)
    ((loss, norm), grads, rng, weights), ((loss2, norm2), grads2, rng2, weights2), stats = \
        standin.own_and_exact_steps()
    trained = standin.args.bestofn if key == "hunyuan" and standin.args.bestofn != B else B
    assert len(grads) == len(grads2) == trained // 2
    assert all(rel(g2, g) < 1e-12 for g, g2 in zip(grads, grads2))
    # the loss sums terms of about 0.1 to a few 1e-6: compared in absolute terms, as the other trainers'
    assert torch.equal(rng, rng2) and abs(loss2 - loss) < 1e-14 and abs(norm2 - norm) <= 1e-12 * norm
    assert rel(weights2, weights) < 1e-12
    files = reward_lines()   # one line from upstream's step, one from the restated one: the same
    assert set(files) == ({"vq_reward.txt", "mq_reward.txt"} if key == "hunyuan" else {"reward.txt"})
    assert all(len(lines) == 2 and lines[0] == lines[1] for lines in files.values())
    assert stats["transformer_backwards"] == trained * int(7 * 0.6) and stats["transformer_forwards_nograd"] == B * S
    if key == "hunyuan":   # both rewards in the metrics line, and the reward the loss weighs
        assert {"vq_reward_mean", "mq_reward_mean", "reward_mean"} <= set(stats)
        a = standin.args
        assert stats["reward_mean"] == pytest.approx(a.vq_coef * stats["vq_reward_mean"] + a.mq_coef *
                                                     stats["mq_reward_mean"], rel=1e-6)


@pytest.mark.filterwarnings("ignore:To copy construct from a tensor")
def test_hunyuan_rewards_of_more_digits_than_float32_train_and_print_as_upstreams(cache_dir, tmp_path,
                                                                                monkeypatch):
    """VideoAlign's scores given as float64 tensors: upstream casts them to float32 before the
    advantages and writes the float's full repr to ./vq_reward.txt / ./mq_reward.txt; exact mode's
    gradient, returns and files are its own step's."""
    setup = standin_setup()
    plain = setup.VideoAlign.reward

    def float64_scores(self, videos, prompts, use_norm=True):
        scores = plain(self, videos, prompts, use_norm)[0]
        return [{k: torch.tensor(v, dtype=torch.float64) / 3 for k, v in scores.items()}]
    monkeypatch.setattr(setup.VideoAlign, "reward", float64_scores)
    standin = Standin("hunyuan", cache_dir, tmp_path, "--bestofn", 3, "--mq_coef", 0.5)
    ((loss, norm), grads, _, _), ((loss2, norm2), grads2, _, _), _ = standin.own_and_exact_steps()
    assert all(rel(g2, g) < 1e-12 for g, g2 in zip(grads, grads2)) and abs(loss2 - loss) < 1e-14
    files = reward_lines()
    assert all(len(lines) == 2 and lines[0] == lines[1] for lines in files.values()), files
    # the full repr of a float32 mean: more digits than '%.4f', and exactly a float32 value
    assert all(len(lines[0]) > 8 and float(torch.tensor(float(lines[0]), dtype=torch.float32)) == float(lines[0])
               for lines in files.values()), files


# key, flags, --use_group, window, jagg_frac, backward, alpha, reuse
JAGG = [("hunyuan", (), True, 4, 1.0, "joint", "timestep", "off"),
        ("hunyuan", ("--bestofn", 2, "--mq_coef", 0.5), True, 4, 1.0, "split", "index", "on_policy"),
        ("hunyuan", ("--bestofn", 3, "--timestep_fraction", 1.0), True, 4, 0.6, "batched", "timestep", "on_policy"),
        ("hunyuan", (), False, 4, 1.0, "batched", "index", "off"),
        ("skyreels", (), True, 4, 1.0, "batched", "timestep", "on_policy"),
        ("skyreels", ("--cfg_infer", 3.0), True, 4, 1.0, "joint", "index", "on_policy"),
        ("skyreels", ("--cfg_infer", 3.0, "--timestep_fraction", 1.0), False, 4, 0.6, "split", "timestep", "off"),
        ("skyreels", (), False, 4, 0.6, "split", "index", "off")]


@pytest.mark.parametrize("key, flags, grouped, window, frac, backward, alpha, reuse", JAGG,
                         ids=[f"{k}-{'-'.join(map(str, f)).replace('--', '') or 'defaults'}-"
                              f"{'group' if g else 'nogroup'}-W{w}-frac{fr}-{b}-{a}-{r}"
                              for k, f, g, w, fr, b, a, r in JAGG])
def test_jagg_equals_the_independent_reference(key, flags, grouped, window, frac, backward, alpha, reuse, cache_dir,
                                               tmp_path):
    """GA = the samples trained (one optimizer step, every sample on-policy)."""
    probe = Standin(key, cache_dir, tmp_path, *flags, group=grouped)
    trained_samples = probe.args.bestofn if key == "hunyuan" and probe.args.bestofn != B else B
    standin = Standin(key, cache_dir, tmp_path, *flags, "--gradient_accumulation_steps", trained_samples,
                      group=grouped)
    (grad,), stats, result, rng, _ = video_jagg_step(standin, window=window, jagg_frac=frac, backward=backward,
                                                     alpha=alpha, reuse=reuse)
    rewards = video_rollout(standin, result)[0]
    advantages = video_advantages(standin, rewards)
    n = int(7 * standin.args.timestep_fraction)
    rows, steps = video_selection_and_draw(standin, advantages, rng, n)
    reference = reference_video_gradient(standin, result, rows, steps, advantages, window, frac, alpha)
    assert rel(grad, reference) < 1e-9
    groups = [list(range(n))[i:i + window] for i in range(0, n, window)]
    n_jagg = int(len(groups) * frac + 0.5)
    backwards = sum(2 if g < n_jagg else len(m) for g, m in enumerate(groups))
    middles = sum(len(m) - 2 for g, m in enumerate(groups) if g < n_jagg)
    assert stats["transformer_backwards"] == trained_samples * backwards
    assert stats["jagg_groups"] == trained_samples * n_jagg
    reused = trained_samples * middles if reuse == "on_policy" else 0
    assert stats["transformer_forwards_reused"] == reused
    assert stats["transformer_forwards_nograd"] == B * S + trained_samples * middles - reused


def test_an_earlier_hunyuan_release_runs_jagg_as_the_reference(cache_dir, tmp_path):
    """be8cf11's flux_step drops the log-density's constant terms: the gradient is its own grpo_one_step's."""
    standin = Standin("hunyuan", cache_dir, tmp_path, "--gradient_accumulation_steps", B,
                      path=write_release(tmp_path / "checkout", "hunyuan@be8cf11"))
    (grad,), stats, result, rng, _ = video_jagg_step(standin, window=4, jagg_frac=1.0, backward="split", reuse="off")
    advantages = video_advantages(standin, video_rollout(standin, result)[0])
    rows, steps = video_selection_and_draw(standin, advantages, rng, 4)
    assert rel(grad, reference_video_gradient(standin, result, rows, steps, advantages, 4, 1.0)) < 1e-9


@pytest.mark.parametrize("flags, config, said", [
    (("--bestofn", 2, "--gradient_accumulation_steps", 4), {}, "exceeds the 2 samples a rank trains"),
    (("--bestofn", 10), {}, "--bestofn 10 needs at least 5 samples per rank, the rank draws 4"),
    (("--cfg_infer", 3.0), {"backward": "batched"}, "--jagg_backward batched with --cfg_infer 3.0")],
    ids=["ga-over-best-of-n", "best-of-n-over-twice-the-batch", "skyreels-guided-batched"])
def test_what_upstream_cannot_run_is_refused_before_the_rollout(flags, config, said, cache_dir, tmp_path):
    key = "skyreels" if "--cfg_infer" in flags else "hunyuan"
    standin = Standin(key, cache_dir, tmp_path, *flags)
    box, original = recorded_rollout(standin.module)
    apply(standin.module, **config)
    try:
        with pytest.raises(ValueError) as refused:
            standin.step()
    finally:
        revert(standin.module)
        standin.module.sample_reference_model = original
    assert said in str(refused.value) and "\n" not in str(refused.value)
    assert box == {}   # no rollout ran


def test_the_launcher_plans_video_in_mib_and_turns_auto_to_split_where_batched_cannot_run(capsys, monkeypatch):
    import argparse
    from jagg_patch.upstream.__main__ import jagg_parser, preflight
    # upstream's HunyuanVideo recipe: 480 x 480 x 53 frames, S 16, 24 generations, best of 8, GA 4; no --clip_range
    hunyuan = argparse.Namespace(use_group=True, train_batch_size=1, num_generations=24, gradient_accumulation_steps=4,
                                 sampling_steps=16, timestep_fraction=0.6, h=480, w=480, t=53, bestofn=8, vq_coef=1.0,
                                 mq_coef=0.0, use_videoalign=True)
    preflight(hunyuan, jagg_parser().parse_args([]), "hunyuan")
    plan = capsys.readouterr().out
    latent_bytes = 16 * 16 * 14 * 60 * 60 * 4   # S x 16 channels x 14 latent frames x 60 x 60, float32 on CPU
    assert f"{latent_bytes / 2 ** 20:.2f} MiB per sample" in plan and "HunyuanVideo model gets" in plan
    assert "as the model computes them: float32)" in plan   # a CPU-only machine (it said bf16 autocast)
    # SkyReels' recipe (cfg 5) on 2 ranks (before their process group exists): auto would pick batched, which its
    # guided call cannot run
    from jagg_patch.upstream import __main__ as launcher
    from jagg_patch.settings import resolve_backward
    monkeypatch.setattr(launcher, "resolve_backward", lambda backward: resolve_backward(backward, world_size=2))
    skyreels = argparse.Namespace(use_group=True, train_batch_size=1, num_generations=8, gradient_accumulation_steps=8,
                                  sampling_steps=16, timestep_fraction=0.6, h=400, w=640, t=53, cfg_infer=5.0,
                                  use_videoalign=True)
    jagg = jagg_parser().parse_args([])
    preflight(skyreels, jagg, "skyreels_i2v")
    out = capsys.readouterr().out
    assert jagg.jagg_backward == "split" and "notice: --jagg_backward auto runs split here" in out
    assert f"{2 * 16 * 16 * 14 * 50 * 80 * 4 / 2 ** 20:.2f} MiB per sample" in out   # doubled by the guided call
    with pytest.raises(SystemExit) as stop:
        preflight(skyreels, jagg_parser().parse_args(["--jagg_backward", "batched"]), "skyreels_i2v")
    assert stop.value.code == 2 and "--jagg_backward batched with --cfg_infer 5.0" in capsys.readouterr().err


def test_hunyuan_flags_that_train_nothing_are_named_at_the_preflight(capsys):
    """--bestofn 0 is named as itself (it was blamed on --gradient_accumulation_steps); a batch with no
    whole block of num_generations without --use_group runs as upstream (loss 0) with a notice."""
    import argparse
    from jagg_patch.upstream.__main__ import jagg_parser, preflight
    flags = dict(use_group=True, train_batch_size=1, num_generations=4, gradient_accumulation_steps=2,
                 sampling_steps=8, timestep_fraction=0.6, h=64, w=64, t=1, bestofn=0, vq_coef=1.0, mq_coef=0.0,
                 use_videoalign=True)
    with pytest.raises(SystemExit) as stop:
        preflight(argparse.Namespace(**flags), jagg_parser().parse_args([]), "hunyuan")
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "--bestofn must be at least 1, got 0" in err and "gradient_acc" not in err
    idle = dict(flags, use_group=False, train_batch_size=2, num_generations=3, bestofn=3)
    preflight(argparse.Namespace(**idle), jagg_parser().parse_args([]), "hunyuan")
    assert "every sample gets advantage 0 and train nothing (as upstream)" in capsys.readouterr().out
    preflight(argparse.Namespace(**dict(idle, train_batch_size=3)), jagg_parser().parse_args([]), "hunyuan")
    assert "notice" not in capsys.readouterr().out


def test_a_hunyuan_run_through_the_launcher_is_read_by_compare(tmp_path):
    """`python -m jagg_patch.upstream` on the HunyuanVideo stand-in: both reward files in the working folder,
    both rewards in jagg_metrics.jsonl, and compare reads the run folder and the plain reward files."""
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-m", "jagg_patch.upstream", "--jagg_window", "4", "--jagg_frac", "1",
                          os.path.join(STANDIN, "fastvideo", "train_grpo_hunyuan.py"), "--output_dir", str(out),
                          "--use_group", "--use_videoalign", "--num_generations", "4", "--bestofn", "2",
                          "--gradient_accumulation_steps", "2", "--sampling_steps", "6", "--timestep_fraction", "1",
                          "--max_train_steps", "2"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": REPO_ROOT})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "reward files ./vq_reward.txt, ./mq_reward.txt" in run.stdout
    records = [json.loads(line) for line in open(out / "jagg_metrics.jsonl")]
    assert len(records) == 2 and all({"vq_reward_mean", "mq_reward_mean"} <= set(r) for r in records)
    # 2 samples (best of 2) x 5 transitions: a JAGG group of 4 (2 backwards) and one exact transition each
    assert all(r["transformer_backwards"] == 2 * 3 and r["jagg_groups"] == 2 for r in records), records
    vq = [float(x) for x in open(tmp_path / "vq_reward.txt")]
    assert vq == pytest.approx([r["vq_reward_mean"] for r in records], abs=1e-4)
    from jagg_patch.tools.compare import load_metrics
    plain = load_metrics(str(tmp_path))   # a plain upstream HunyuanVideo run's folder: the two reward files
    assert [r["vq_reward_mean"] for r in plain] == vq and len(plain) == 2 and "mq_reward_mean" in plain[0]


def test_a_hunyuan_file_without_its_second_reward_file_is_stopped_at_apply(tmp_path):
    """The restated step writes one file per reward: a train_one_step naming only ./vq_reward.txt is a
    change (one line), or runs writing that one under --jagg_allow_upstream_changes."""
    from jagg_patch.upstream import UpstreamChanged, UpstreamSourceChanged, load_trainer
    from upstream_harness import copy_checkout, standin_file
    path = standin_file("hunyuan", copy_checkout(tmp_path / "checkout"))
    text = open(path).read()
    assert text.count('"./mq_reward.txt"') == 1
    open(path, "w").write(text.replace('"./mq_reward.txt"', 'f"./mq_{0}.log"'))
    module = load_trainer(path)
    with pytest.raises(UpstreamChanged) as stopped:
        apply(module)
    assert "names the reward files ['./vq_reward.txt'], the hunyuan trainer reports 2 rewards (vq, mq)" in str(
        stopped.value) and "\n" not in str(stopped.value)
    with pytest.warns(UpstreamSourceChanged, match="running anyway: --jagg_allow_upstream_changes"):
        apply(module, allow_upstream_changes=True)
    revert(module)
