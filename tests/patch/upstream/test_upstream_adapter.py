"""jagg_patch.upstream on stand-ins of upstream's trainer files (tests/upstream_standin: upstream's
names, signatures, return values, inline update loop and __main__ parser, written from the
references, built on dancegrpo's SDE step and the tiny preset's models; `fastvideo/` a namespace
package, the checkout never installed nor on PYTHONPATH), in float64 on a one-rank gloo group:
- exact mode reproduces the stand-in's own train_one_step (gradient at every optimizer step,
  returns, global RNG state afterwards), for every trainer;
- JAGG equals jagg_patch's own JAGG on this project's trainer for the same rollout and trained
  transitions (both alpha rules, every backward form), and its pass counts are hook-counted;
- the fingerprint stops on a changed signature or rollout arity and warns on a changed body.
Earlier releases, Qwen-Image-Edit and Wan 2.1: test_upstream_releases.py, test_upstream_video_edit.py.
"""
import argparse
import dataclasses
import errno
import os
import subprocess
import sys

import pytest
import torch

from dancegrpo import trainer
from dancegrpo.models.flux import FluxFamily
from dancegrpo.models.qwenimage import QwenImageFamily
from dancegrpo.algo.sde import model_timesteps, sigma_schedule
from dancegrpo.build import TrainContext
from dancegrpo.engines import FSDPEngine
from jagg_patch import JaggConfig, make_policy_update, make_window_selection
from jagg_patch.upstream import (UpstreamChanged, UpstreamSourceChanged, apply, fingerprint, load_trainer, revert,
                                 run_main_block, token_hash)
from jagg_patch.upstream.fingerprint import family_of
from jagg_patch.seams import UpstreamRelease
from helpers import REPO_ROOT, dist_check, dist_id, missing_diffusers_class, read_jsonl
from upstream_harness import (B, FAMILY, FILES, GA, STANDIN, VIDEO, Standin, copy_checkout, forget_fastvideo,  # noqa: F401
                              grad_of, in_tmp, one_rank_group, standins_known, recorded_rollout, rel, standin_file,
                              write_changed)

ROOT = REPO_ROOT
# The stand-ins are no release of upstream's, so each apply warns (UpstreamSourceChanged); the tests
# of that warning catch it themselves.
pytestmark = pytest.mark.filterwarnings("ignore::jagg_patch.upstream.UpstreamSourceChanged")


# ---------------------------------------------------------------- loading and the launcher

def test_load_trainer_runs_the_definitions_not_the_main_block(tmp_path, monkeypatch):
    """From a plain copy of the checkout (fastvideo/ without __init__.py, not installed, not on the path)."""
    root = copy_checkout(tmp_path / "checkout")
    assert not os.path.exists(os.path.join(root, "fastvideo", "__init__.py"))
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != STANDIN])
    module = load_trainer(standin_file("flux", root))
    assert module.__name__ == "fastvideo.train_grpo_flux" and callable(module.train_one_step)
    assert "MAIN_BLOCK_RAN" not in vars(module)
    assert sys.path[1] == root   # the checkout root, after the script's folder: `fastvideo.*` imports resolve
    assert module.latent_reward.__module__ == "fastvideo.utils.standin_setup"
    with pytest.raises(SystemExit) as stop:   # the block itself: upstream's inline parser
        run_main_block(module, ["--help"])
    assert stop.value.code == 0 and vars(module)["MAIN_BLOCK_RAN"]
    assert [family_of(load_trainer(standin_file(f, root))) for f in FILES] == [FAMILY[f] for f in FILES]


def write_decoy(folder):
    """Another checkout's fastvideo (installed, or on PYTHONPATH), whose helpers fail on import."""
    utils = folder / "fastvideo" / "utils"
    utils.mkdir(parents=True)
    (utils / "__init__.py").write_text("")
    (utils / "standin_setup.py").write_text("raise ImportError('the decoy checkout was imported')\n")
    return str(folder)


def test_the_file_given_decides_which_checkout_fastvideo_comes_from(tmp_path, monkeypatch):
    decoy = write_decoy(tmp_path / "decoy")
    (tmp_path / "decoy" / "fastvideo" / "utils" / "other.py").write_text("FROM = 'decoy'\n")
    monkeypatch.setattr(sys, "path", [decoy, *sys.path])
    forget_fastvideo()
    import fastvideo.utils.other   # noqa: F401  (imported from the decoy before the trainer is loaded)
    root = copy_checkout(tmp_path / "checkout")
    module = load_trainer(standin_file("qwenimage", root))
    assert module.latent_reward.__code__.co_filename.startswith(root)
    assert "fastvideo.utils.other" not in sys.modules   # the other checkout's modules are forgotten


def test_a_symlinked_trainer_file_takes_its_checkout_from_where_the_file_really_is(tmp_path, monkeypatch):
    """The link sits in another checkout's fastvideo/ (on the path): its folder must not decide."""
    decoy = write_decoy(tmp_path / "decoy")
    monkeypatch.setattr(sys, "path", [decoy, *sys.path])
    forget_fastvideo()
    root = copy_checkout(tmp_path / "checkout")
    link = os.path.join(decoy, "fastvideo", "train_grpo_flux.py")
    os.symlink(standin_file("flux", root), link)
    module = load_trainer(link)
    assert module.__file__ == os.path.realpath(standin_file("flux", root))
    assert module.latent_reward.__code__.co_filename.startswith(root)


def launch(*argv, cwd, path=(), known=True):
    """`python -m jagg_patch.upstream ARGV` in a process of its own; known: the stand-ins as known
    releases (tests/upstream_launch.py), so that the restated step runs them."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([ROOT, *path]))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    entry = [os.path.join(ROOT, "tests", "upstream_launch.py")] if known else ["-m", "jagg_patch.upstream"]
    return subprocess.run([sys.executable, *entry, *map(str, argv)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_launcher_strips_the_jagg_flags_and_runs_upstreams_main(cache_dir, tmp_path):
    """A plain copy of the checkout, run from outside it, with another checkout's fastvideo on PYTHONPATH."""
    out, root = tmp_path / "run", copy_checkout(tmp_path / "checkout")
    # JAGG flags before the file and among upstream's: upstream's strict parser would refuse any of them.
    run = launch("--jagg_window", 4, "--jagg_frac", "auto", standin_file("flux", root), "--cache_dir", cache_dir,
                 "--output_dir", out, "--use_group", "--num_generations", B, "--jagg_backward", "split",
                 "--gradient_accumulation_steps", B, "--max_train_steps", 2, cwd=tmp_path,
                 path=[write_decoy(tmp_path / "decoy")])
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert ("jagg_patch.upstream: train_grpo_flux.py: family flux, train_one_step of train_grpo_flux.py (the stand-in)"
            in run.stdout)
    assert "JAGG plan (grouping trained, alpha timestep, backward split" in run.stdout
    assert "step 2 loss" in run.stdout   # upstream's own main ran its loop
    lines = read_jsonl(out / "jagg_metrics.jsonl")
    assert [r["step"] for r in lines] == [1, 2] and lines[0]["run_id"] == lines[1]["run_id"]
    # --jagg_frac auto without --jagg_monitor_every: measured at step 1 (then every 10), routed from then on
    assert "measured with --jagg_monitor_every 10" in run.stdout and "step 1: JAGG routing (auto" in run.stdout
    assert "jagg_cos/g0" in lines[0] and "jagg_cos/g0" not in lines[1] and lines[0]["jagg_cos/g0"] >= 0.8
    assert [r["jagg_routed"] for r in lines] == [1, 1]
    # One group of 4 per sample: 2 backwards, the middles from the rollout (every sample on-policy). Upstream's
    # micro-batch is one sample: step 1's measurement spans its first --jagg_monitor_samples samples, and the
    # routing it chooses applies from the last of them on; those before it train exact (4 backwards).
    assert "notice: the JAGG monitor measures the 4 samples a rank trains per step" in run.stdout
    early = min(JaggConfig().monitor_samples, B) - 1
    assert lines[1]["transformer_backwards"] == 2 * B and lines[1]["transformer_forwards_reused"] == 2 * B
    assert lines[0]["transformer_backwards"] == 4 * early + 2 * (B - early)
    assert lines[0]["transformer_forwards_reused"] == 2 * (B - early)
    assert len((tmp_path / "reward.txt").read_text().splitlines()) == 2


def test_launcher_stops_on_a_changed_upstream_before_loading_models(tmp_path):
    changed = write_changed(tmp_path, "flux", "def grpo_one_step(args, latents, pre_latents,",
                            "def grpo_one_step(args, latents, next_latents,")
    run = launch("--jagg_window", 4, changed, "--cache_dir", tmp_path, "--output_dir", tmp_path / "o", cwd=tmp_path)
    assert run.returncode == 2
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("error: upstream changed") and "grpo_one_step" in last and "next_latents" in last
    assert "--jagg_allow_upstream_changes" in last


# ---------------------------------------------------------------- exact mode == upstream's own step

@pytest.mark.parametrize("key", [k for k in FILES if k not in VIDEO])   # the video trainers: test_upstream_video
def test_exact_mode_reproduces_upstreams_own_step(key, cache_dir, tmp_path):
    standin = Standin(key, cache_dir, tmp_path)
    ((loss, norm), grads, rng, weights), ((loss2, norm2), grads2, rng2, weights2), stats = \
        standin.own_and_exact_steps()
    assert len(grads) == len(grads2) == B // GA
    assert all(rel(g2, g) < 1e-12 for g, g2 in zip(grads, grads2))   # measured ~1e-16
    assert torch.equal(rng, rng2)   # the same draws, in the same order
    # The loss is a sum of per-transition terms of either sign (~1e-2 each) that nearly cancel:
    # compared in absolute terms, to well below one term's float64 rounding times their number.
    assert abs(loss2 - loss) < 1e-14 and abs(norm2 - norm) <= 1e-12 * norm
    assert rel(weights2, weights) < 1e-12
    n = int((8 - 1) * 0.6)
    # Wan's calls are classifier-free guided (--cfg_infer 5): one call on a doubled batch counts once per sample
    assert stats["transformer_forwards_grad"] == stats["transformer_backwards"] == B * n
    assert stats["transformer_forwards_nograd"] == B * 8   # the rollout
    assert (tmp_path / "reward.txt").read_text() == f"{stats['reward_mean']!r}\n" * 2   # upstream's line, then ours
    assert (stats["exact_groups"], stats["jagg_groups"], stats["transformer_forwards_reused"]) == (B, 0, 0)


# ---------------------------------------------------------------- JAGG == jagg_patch's JAGG on this trainer

def project_context(make_args, family, transformer):
    """The slice of this project's TrainContext that its update reads, on the same model."""
    module = "dancegrpo.train_grpo_qwenimage" if family == "qwenimage" else "dancegrpo.train_grpo_flux"
    args = make_args("--clip_range", "0.05", "--update_batch_size", 1, "--gradient_accumulation_steps", B,
                     module=module)
    family_class = QwenImageFamily if family == "qwenimage" else FluxFamily
    sigmas = sigma_schedule(args.sampling_steps, args.shift)
    return TrainContext(args=args, family=family_class(args), transformer=transformer, raw_transformer=transformer,
                        vae=None, reward_fn=None, loader=None, device=torch.device("cpu"), counter=None,
                        sigmas=sigmas, timesteps=model_timesteps(sigmas),
                        engine=FSDPEngine(transformer, None, None, args.max_grad_norm))


def project_cond(family, batch):
    if family == "qwenimage":
        embeds, masks = batch[0], batch[1]
        cond = {"encoder_hidden_states": embeds, "encoder_hidden_states_mask": masks}
    else:
        cond = {"encoder_hidden_states": batch[0], "pooled_prompt_embeds": batch[1], "text_ids": batch[2]}
    return {k: v.repeat_interleave(B, dim=0) for k, v in cond.items()}


@pytest.mark.parametrize("family, alpha, backward, grouping", [
    ("flux", "timestep", "joint", "trained"), ("flux", "timestep", "split", "trained"),
    ("flux", "index", "joint", "trained"), ("flux", "index", "split", "trained"),
    ("flux", "timestep", "batched", "trained"), ("qwenimage", "timestep", "joint", "trained"),
    ("flux", "index", "split", "window")])
def test_jagg_equals_jagg_patch_on_this_projects_trainer(family, alpha, backward, grouping, cache_dir, tmp_path,
                                                         make_args):
    """W 4 (trained grouping: the 4 trained transitions are one group; window grouping, the authors':
    windows (0-3), (4-6), one of them drawn per sample at timestep_fraction 0.6)."""
    standin = Standin(family, cache_dir, tmp_path, "--gradient_accumulation_steps", B)
    box, original = recorded_rollout(standin.module)
    apply(standin.module, window=4, jagg_frac=1.0, alpha=alpha, backward=backward, reuse="off", grouping=grouping)
    try:
        _, (adapter_grad,), _, _ = standin.step()
    finally:
        revert(standin.module)
        standin.module.sample_reference_model = original
    rewards, all_latents, all_log_probs, _, _ = box["result"]
    # The trained transitions as drawn right after the rollout: upstream's, or the authors' windows.
    torch.set_rng_state(box["rng"])
    if grouping == "trained":
        n = int(7 * 0.6)
        steps = torch.stack([torch.randperm(7) for _ in range(B)])[:, :n]
    else:
        selection = make_window_selection(4)(B, 7, 0.6, None)
        steps, n = selection.steps, selection.num_train
        assert n == 4 and len({tuple(row) for row in steps.tolist()}) > 1   # both windows are drawn
    r = rewards.float().reshape(-1, B)
    advantages = ((r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + 1e-8)).reshape(-1)

    ctx = project_context(make_args, family, standin.transformer)
    standin.transformer.load_state_dict(standin.initial)
    standin.transformer.zero_grad(set_to_none=True)
    rollout = trainer.Rollout(all_latents, all_log_probs, [], rewards)
    update = make_policy_update(window=4, jagg_frac=1.0, mode="jagg", alpha=alpha, backward=backward, grouping=grouping, reuse="off")
    trainer.accumulate_policy_gradient(ctx, rollout, project_cond(family, standin.batch), advantages,
                                       torch.arange(B), steps, B * n, update)
    project_grad = grad_of([p for p in standin.transformer.parameters() if p.requires_grad])
    assert rel(adapter_grad, project_grad) < 1e-10


# ---------------------------------------------------------------- counts and rollout reuse

def test_counts_by_hooks_and_the_metrics_line(cache_dir, tmp_path):
    """W 3 over 4 trained transitions: groups (0,1,2) JAGG and (3) exact at jagg_frac 0.5."""
    standin = Standin("flux", cache_dir, tmp_path)
    apply(standin.module, window=3, jagg_frac=0.5, reuse="off", backward="split")
    try:
        standin.step()
        stats = standin.module.train_one_step.last_stats
        apply(standin.module, window=3, jagg_frac=0.5, reuse="on_policy", backward="split")
        standin.step()
        reused = standin.module.train_one_step.last_stats
    finally:
        revert(standin.module)
    assert stats["transformer_backwards"] == B * (2 + 1)          # 2 per JAGG group + size of the exact one
    assert stats["transformer_forwards_grad"] == B * 3
    assert stats["transformer_forwards_nograd"] == B * 8 + B * 1  # the rollout + one middle member
    assert (stats["jagg_groups"], stats["exact_groups"], stats["transformer_forwards_reused"]) == (B, B, 0)
    # GA 2: samples 0 and 1 come before the step's first optimizer step and take their middle from the rollout
    assert reused["transformer_forwards_reused"] == GA
    assert reused["transformer_forwards_nograd"] == B * 8 + (B - GA)
    lines = read_jsonl(tmp_path / "out" / "jagg_metrics.jsonl")
    assert {k: lines[0][k] for k in stats} == stats and lines[1]["reuse"] == "on_policy"
    # the gathered reward, as upstream's ./reward.txt has it (its mean) and its spread, for the comparison
    assert [repr(line['reward_mean']) for line in lines] == (tmp_path / "reward.txt").read_text().split()
    assert all(line["reward_std"] > 0 for line in lines)
    # The PPO statistics over the trained transitions, as the trainer logs them: the first GA samples are
    # on-policy (ratio 1 exactly: the stand-in's rollout and update make the same call), the rest after a step.
    from dancegrpo.algo.ratio_stats import FIELDS
    for line in lines:
        assert set(FIELDS) <= set(line) and line["ratio_min"] <= 1 <= line["ratio_max"]
        assert line["ratio_min"] <= line["ratio_mean"] <= line["ratio_max"] and 0 <= line["clip_frac"] <= 1
    from jagg_patch.tools.compare import load_metrics
    assert load_metrics(str(tmp_path / "out"), warn=lambda message: None) == [lines[1]]   # the last run


def test_the_monitor_measures_what_it_measures_on_this_trainer_and_leaves_the_step(cache_dir, tmp_path, make_args):
    """W 3 over 6 trained transitions (two positions), the monitor at every step: the adapter's step
    with it gives the gradients at every optimizer step, returns, RNG draws and pass counts of the
    step without it, bit for bit; its cosines are those jagg_patch's monitor measures on this
    project's trainer for the same rollout and transitions (the step's first two samples: two
    micro-batches of one in both)."""
    flags = ("--timestep_fraction", 0.9)   # int(7 * 0.9) = 6 trained transitions
    standin = Standin("flux", cache_dir, tmp_path, *flags)
    config = dict(window=3, jagg_frac=1.0, reuse="off", backward="split")
    try:
        apply(standin.module, **config)
        plain = standin.step()
        plain_stats = standin.module.train_one_step.last_stats
        box, original = recorded_rollout(standin.module)
        apply(standin.module, **config, monitor_every=1, monitor_samples=2)
        monitored = standin.step()
        stats = standin.module.train_one_step.last_stats
    finally:
        revert(standin.module)
        standin.module.sample_reference_model = original
    assert plain[0] == monitored[0] and torch.equal(plain[2], monitored[2]) and torch.equal(plain[3], monitored[3])
    assert len(plain[1]) == B // GA and all(torch.equal(a, b) for a, b in zip(plain[1], monitored[1]))
    assert {k: stats[k] for k in plain_stats if not k.endswith("time_s")} == \
        {k: v for k, v in plain_stats.items() if not k.endswith("time_s")}
    assert stats["monitor_forwards"] > 0 and stats["monitor_backwards"] > 0 and stats["monitor_time_s"] > 0

    rewards, all_latents, all_log_probs, _, _ = box["result"]
    torch.set_rng_state(box["rng"])
    steps = torch.stack([torch.randperm(7) for _ in range(B)])[:, :6]
    r = rewards.float().reshape(-1, B)
    advantages = ((r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + 1e-8)).reshape(-1)
    ctx = dataclasses.replace(project_context(make_args, "flux", standin.transformer), step=1)
    standin.transformer.load_state_dict(standin.initial)
    standin.transformer.zero_grad(set_to_none=True)
    update = make_policy_update(window=3, jagg_frac=1.0, mode="jagg", alpha="timestep", backward="split",
                                grouping="trained", reuse="off", monitor_every=1, monitor_samples=2)
    project = trainer.accumulate_policy_gradient(ctx, trainer.Rollout(all_latents, all_log_probs, [], rewards),
                                                 project_cond("flux", standin.batch), advantages, torch.arange(B),
                                                 steps, GA * 6, update).metrics
    measured = sorted(k for k in project if "/g" in k)   # the means and JAGG's cosine's spread, per position
    assert len(measured) == 12 and measured == sorted(k for k in stats if "/g" in k)
    assert project["jagg_cos_n/g0"] == 2
    for key in measured:
        assert stats[key] == pytest.approx(project[key], rel=1e-10, abs=1e-12), key
    assert all(stats[f"jagg_relerr/g{p}"] > 1e-6 for p in range(2))   # W 3: JAGG is not exact here


@pytest.mark.parametrize("min_cos", [-1.0, 1.0])
def test_auto_under_the_adapter_routes_by_the_threshold(cache_dir, tmp_path, min_cos):
    """--jagg_frac auto on the adapter: a threshold every cosine's bound reaches routes both positions to
    JAGG, one none reaches (1.0; measured ~0.99) routes none. Upstream's micro-batch is one sample, so
    the measurement spans samples 0 and 1 and the routing applies from sample 1 on: sample 0 trains
    exact, as every sample does when nothing is routed (the step is then exact mode's, bit for bit)."""
    standin = Standin("flux", cache_dir, tmp_path, "--timestep_fraction", 0.9)
    config = dict(window=3, reuse="off", backward="split")
    try:
        apply(standin.module, **config, jagg_frac="auto", monitor_every=1, monitor_samples=2, min_cos=min_cos)
        auto = standin.step()
        stats = standin.module.train_one_step.last_stats
        apply(standin.module, **{**config, "jagg_frac": 1.0, "mode": "exact"}, restated=True)
        exact = standin.step()
    finally:
        revert(standin.module)
    routed = min_cos < 0
    assert stats["jagg_routed"] == (0b11 if routed else 0)
    assert (stats["jagg_groups"], stats["exact_groups"]) == ((2 * (B - 1), 2) if routed else (0, 2 * B))
    if not routed:
        assert all(torch.equal(a, b) for a, b in zip(auto[1], exact[1])) and torch.equal(auto[3], exact[3])


def test_a_rollout_that_does_not_match_its_latents_is_not_reused():
    from jagg_patch.upstream.rollout_record import RolloutRecorder
    model = torch.nn.Linear(3, 3)
    latents = torch.randn(2, 3, 4, 3)   # 2 samples, S = 2 transitions
    with RolloutRecorder(model) as recorder:
        for b in range(2):
            for k in range(2):
                model(latents[b:b + 1, k])
    assert torch.equal(recorder.outputs(latents)[1, 0], model(latents[1:2, 0]).detach())
    with RolloutRecorder(model) as recorder:
        for b in range(2):
            for k in range(2):
                model(latents[b:b + 1, k] + (b == 1 and k == 1))   # one call fed something else
    with pytest.warns(UserWarning, match="not reused this step"):
        assert recorder.outputs(latents) is None


def test_guided_calls_on_chunks_with_condition_tokens_are_laid_out_per_sample():
    """A call on 2 samples of a guided trainer holds their 2 conditional rows, then their 2
    unconditional ones, each followed by 2 condition tokens: sample b's output at step k is its rows
    (b, 2 + b), as a call on sample b alone returns them."""
    from jagg_patch.upstream.rollout_record import RolloutRecorder
    model = torch.nn.Linear(3, 3)
    latents, condition = torch.randn(4, 3, 4, 3), torch.randn(4, 2, 3)   # 4 samples, S = 2, 4 tokens (+ 2)

    def call(rows, k, perturb=0.0):
        x = torch.cat([latents[rows, k], condition[rows]], dim=1)
        return model(torch.cat([x, x + perturb]))   # the unconditional rows: another input, the same latents

    with RolloutRecorder(model, rows=2) as recorder:
        for chunk in ([0, 1], [2, 3]):
            for k in range(2):
                call(chunk, k, perturb=torch.zeros(1, 6, 3).index_fill_(1, torch.tensor([5]), 1.0))
    outputs = recorder.outputs(latents)
    alone = call([3], 1, perturb=torch.zeros(1, 6, 3).index_fill_(1, torch.tensor([5]), 1.0)).detach()
    assert outputs.shape == (4, 2, 2, 6, 3) and torch.allclose(outputs[3, 1], alone, rtol=0, atol=1e-6)
    with RolloutRecorder(model, rows=2) as recorder:
        for chunk in ([0, 1], [2, 3]):
            for k in range(2):
                call(chunk, k, perturb=1.0)   # the second block no longer begins with the stored latents
    with pytest.warns(UserWarning, match="not reused this step"):
        assert recorder.outputs(latents) is None


def test_reused_rollout_outputs_give_the_recomputed_gradient(cache_dir, tmp_path):
    standin = Standin("qwenimage", cache_dir, tmp_path)
    results, reused = {}, {}
    try:
        for reuse in ("off", "on_policy"):
            apply(standin.module, window=4, jagg_frac=1.0, reuse=reuse, backward="joint")
            results[reuse] = standin.step()
            reused[reuse] = standin.module.train_one_step.last_stats["transformer_forwards_reused"]
    finally:
        revert(standin.module)
    assert reused == {"off": 0, "on_policy": 2 * GA}   # the middles of the samples before the first step
    assert all(rel(a, b) < 1e-12 for a, b in zip(results["on_policy"][1], results["off"][1]))


# ---------------------------------------------------------------- the fingerprint

def test_a_changed_signature_stops_with_one_line_naming_it(tmp_path):
    module = load_trainer(write_changed(tmp_path, "flux", "def grpo_one_step(args, latents, pre_latents,",
                                        "def grpo_one_step(args, latents, next_latents,"))
    with pytest.raises(UpstreamChanged) as stop:
        apply(module)
    message = str(stop.value)
    assert "\n" not in message and "grpo_one_step" in message
    assert "lost ['pre_latents']" in message and "gained ['next_latents']" in message and "15cc71d" in message
    assert module.train_one_step.__module__ != "jagg_patch.upstream.patch"   # nothing was replaced
    with pytest.warns(UpstreamSourceChanged, match="grpo_one_step"):
        apply(module, allow_upstream_changes=True)
    revert(module)


def test_a_changed_rollout_arity_stops(tmp_path):
    module = load_trainer(write_changed(tmp_path, "flux", "    return (torch.cat(all_rewards),", "    return ("))
    with pytest.raises(UpstreamChanged, match="sample_reference_model returns \\[4\\] values, expected 5"):
        apply(module)


def test_a_changed_body_runs_its_own_code_deferred(tmp_path, capsys):
    """A train_one_step that is no recorded release (one line edited) runs as it is, its backward deferred,
    never the restated step, said in one line naming the nearest recorded release."""
    pristine = load_trainer(standin_file("qwenimage"))
    params = tuple(__import__("inspect").signature(pristine.train_one_step).parameters)
    recorded = (UpstreamRelease(token_hash(pristine.train_one_step), "qwenimage", "the stand-in", params,
                                "./reward.txt"),)
    apply(pristine, releases=recorded)   # the recorded source: the restated step, nothing said
    assert pristine.train_one_step.jagg_trainer.release is recorded[0]
    assert pristine.train_one_step.jagg_update == "restated" and "notice" not in capsys.readouterr().out
    revert(pristine)
    # A comment or layout change is not a change of the source.
    relaid = load_trainer(write_changed(tmp_path, "qwenimage", "    total_loss = 0.0\n",
                                        "    # upstream's running loss\n\n    total_loss = 0.0\n"))
    assert token_hash(relaid.train_one_step) == recorded[0].token_hash
    changed = load_trainer(write_changed(tmp_path, "qwenimage", "    total_loss = 0.0\n", "    total_loss = 0.0 * 1\n"))
    apply(changed, releases=recorded)
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("notice")]
    assert "train_grpo_qwenimage.py: train_one_step is no release jagg_patch.upstream knows" in line
    assert "the nearest known is qwenimage the stand-in" in line and "never the restated step" in line
    assert changed.train_one_step.jagg_update == "deferred" and changed.train_one_step.jagg_trainer.release is None
    revert(changed)
    assert fingerprint(changed)["token_hash"] != recorded[0].token_hash


def test_qwenimage_without_use_group_is_refused_before_the_rollout(cache_dir, tmp_path):
    standin = Standin("qwenimage", cache_dir, tmp_path)
    standin.args.use_group = False
    apply(standin.module)
    try:
        with pytest.raises(ValueError, match="needs --use_group"):
            standin.step()
        assert standin.module.train_one_step.last_stats is None
    finally:
        revert(standin.module)


# ---------------------------------------------------------------- the launcher's own checks

def test_preflight_refuses_what_upstream_would_fail_on_before_main_loads_anything(capsys):
    from jagg_patch.upstream.__main__ import jagg_parser, preflight
    jagg = jagg_parser().parse_args([])
    qwen = argparse.Namespace(use_group=False, train_batch_size=4, num_generations=4, gradient_accumulation_steps=4,
                              sampling_steps=8, timestep_fraction=0.6, h=64, w=64, clip_range=1e-4, adv_clip_max=5.0)
    with pytest.raises(SystemExit) as stop:
        preflight(qwen, jagg, "qwenimage")
    assert stop.value.code == 2 and "add --use_group" in capsys.readouterr().err
    flux = argparse.Namespace(**{**vars(qwen), "use_group": True, "train_batch_size": 1, "num_generations": 2})
    with pytest.raises(SystemExit):
        preflight(flux, jagg, "flux")   # GA 4 > 2 samples per rank: no optimizer step would run
    assert "--gradient_accumulation_steps 4 exceeds the 2 samples" in capsys.readouterr().err
    preflight(argparse.Namespace(**{**vars(flux), "num_generations": 4}), jagg, "flux")
    assert "JAGG plan" in capsys.readouterr().out


@pytest.mark.usefixtures("standins_known")
def test_an_unwritable_output_dir_is_one_line_before_upstreams_main_loads(cache_dir, tmp_path, capsys, monkeypatch):
    """jagg_metrics.jsonl's folder is proved writable first (it was found unwritable after step 1)."""
    from jagg_patch.upstream.__main__ import main
    module_main = []
    (tmp_path / "file").write_text("x")
    monkeypatch.chdir(tmp_path)
    import jagg_patch.upstream.__main__ as launcher
    real_preflight = launcher.preflight
    monkeypatch.setattr(launcher, "preflight", lambda *a: module_main.append(1) or real_preflight(*a))
    with pytest.raises(SystemExit) as stop:
        main([standin_file("flux"), "--cache_dir", cache_dir, "--output_dir", str(tmp_path / "file" / "out"),
              "--use_group", "--num_generations", str(B), "--gradient_accumulation_steps", str(B)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "is not writable" in err and len(err.strip().splitlines()) == 1, err
    assert module_main == [] and not (tmp_path / "reward.txt").exists()


def test_fingerprint_command_prints_what_to_record(capsys):
    from jagg_patch.upstream.__main__ import main
    assert main(["--jagg_fingerprint", standin_file("flux_lora")]) == 0
    printed = capsys.readouterr().out
    module = load_trainer(standin_file("flux_lora"))
    assert "family: flux\n" in printed and f"train_one_step token hash: {token_hash(module.train_one_step)}" in printed
    assert "known release: none" in printed and "'pre_latents'" in printed and "reward files: ./reward.txt\n" in printed
    record = printed.strip().splitlines()[-1]   # the line to put in jagg_patch.seams.UPSTREAM_RELEASES
    assert record.startswith(f"  UpstreamRelease('{token_hash(module.train_one_step)}', 'flux', ")


# ---------------------------------------------------------------- FSDP, as upstream wraps its transformer

@pytest.mark.parametrize("dist_result", [dist_check("upstream-fsdp", "upstream")], indirect=True,
                         ids=dist_id)
@pytest.mark.slow
def test_two_fsdp_ranks_exact_and_jagg(dist_result):
    """tests/dist/upstream_fsdp_check.py on two ranks: exact mode == the stand-in's own step under
    FSDP1 (measured 1.1e-7, float32), and JAGG with backward auto (batched on 2 ranks, one backward
    call per group) and rollout reuse == the mean over ranks of float64 single-process JAGG gradients
    (measured 2.1e-6: FSDP computes in float32)."""
    result = dist_result
    assert result["world_size"] == 2 and result["same_names"] and result["ref_norm"] > 0
    assert result["rel_exact"] < 1e-5 and result["rel_jagg"] < 1e-5, result
    stats = result["stats"]   # summed over the two ranks, as the trainers' records
    assert stats["world_size"] == 2 and stats["samples"] == 2 * B
    assert stats["backward_calls"] == 2 * B and stats["transformer_backwards"] == 2 * 2 * B
    assert stats["transformer_forwards_reused"] == 2 * 2 * B and stats["jagg_groups"] == 2 * B
    hunyuan = result["hunyuan"]   # FSDP's own clip: the full gradient's norm, clipped to 1e-4 on every rank
    assert hunyuan["rel_exact"] < 1e-5 and hunyuan["norm_rel"] < 1e-5 and hunyuan["clipped_norm"] < 1.01e-4, hunyuan
    assert hunyuan["rel_jagg"] < 1e-5 and hunyuan["same_names"], hunyuan
    # best of 2, 5 transitions each: a JAGG group of 4 (one batched backward call) and one exact transition
    assert (hunyuan["backwards"], hunyuan["backward_calls"]) == (2 * 2 * 3, 2 * 2 * 2), hunyuan   # both ranks


@pytest.mark.skipif(bool(missing_diffusers_class("WanTransformer3DModel")),
                    reason=str(missing_diffusers_class("WanTransformer3DModel")))
@pytest.mark.parametrize("dist_result", [dist_check("upstream-fsdp-wan", "upstream", ["wan"])], indirect=True,
                         ids=dist_id)
@pytest.mark.slow
def test_two_fsdp_ranks_wan_exact(dist_result):
    """Wan under FSDP1: exact mode clips each rank's shard by its own norm, as upstream's clip_grad_norm_ does."""
    wan = dist_result["wan"]
    assert wan["rel_exact"] < 1e-6 and wan["norm_equal"] and wan["norm_differs_over_ranks"], wan
    assert wan["note_lines"] == 1, wan   # rank 0's result: the line once in two steps


@pytest.mark.parametrize("argv, said", [
    (["{tmp}"], "is a folder; give the trainer file in it, e.g. {tmp}/fastvideo/train_grpo_hunyuan.py (or 1 more"),
    (["{tmp}/fastvideo"], "is a folder; give the trainer file in it, e.g. {tmp}/fastvideo/train_grpo_hunyuan.py"),
    (["{tmp}/notes.txt"], "is not a Python file"),
    (["{tmp}/broken.py"], "is not valid Python (line 1"),
    (["{tmp}/plain.py"], "has no function train_one_step"),
    (["{tmp}/raises.py"], "its top-level code raised ZeroDivisionError"),
    (["--jagg_window", "4"], "no trainer file given"),
    (["--jagg_window", "4", "--use_group", "x.py"], "unknown flag --use_group before the trainer file (its own "
                                                    "flags go after it)"),
    (["--jagg_windw", "4", "x.py"], "unknown flag --jagg_windw; did you mean --jagg_window?"),
    (["x.py", "--use_group", "--jagg_fraq", "1"], "unknown flag --jagg_fraq; did you mean --jagg_frac?"),
    (["{tmp}/fastvideo/train_grpo_sd.py"], "No module named 'absl_not_installed' (run it with upstream's "
                                           "environment"),
    (["{tmp}/fastvideo/train_grpo_hunyuan.py"], "No module named 'wandb_not_installed'"),
    (["{tmp}/linked.py"], "No module named 'wandb_not_installed'"),
    (["{tmp}/renamed_sd.py"], "renamed_sd.py has no function train_one_step")],
    ids=["folder", "package-folder", "not-py", "syntax", "no-train-one-step", "raises", "none", "flag-first", "jagg-typo-first",
         "jagg-typo-after", "sd-without-its-packages",
         "hunyuan-93ec253-without-its-packages", "link-to-it", "sd-shape-under-another-name"])
def test_a_wrong_trainer_file_is_one_line_and_exit_2(argv, said, tmp_path, capsys):
    from jagg_patch.upstream.__main__ import main
    (tmp_path / "fastvideo").mkdir()
    # SD (by its name) and the 93ec253 HunyuanVideo trainer (its 26-parameter train_one_step) run as they are,
    # deferred: loaded, they need upstream's environment (said in one line, exit 2)
    (tmp_path / "fastvideo" / "train_grpo_sd.py").write_text("import absl_not_installed\n")
    params = ", ".join(f"p{i}" for i in range(26))
    (tmp_path / "fastvideo" / "train_grpo_hunyuan.py").write_text(
        f"import wandb_not_installed\n\n\ndef train_one_step({params}):\n    pass\n")
    os.symlink(tmp_path / "fastvideo" / "train_grpo_hunyuan.py", tmp_path / "linked.py")
    # SD's shape under another name: its loop inline in main(), started by absl; refused from its syntax tree
    (tmp_path / "renamed_sd.py").write_text("from absl import app\n\n\ndef main(_):\n    pass\n\n\n"
                                           "if __name__ == '__main__':\n    app.run(main)\n")
    (tmp_path / "notes.txt").write_text("not a trainer\n")
    (tmp_path / "broken.py").write_text("def train_one_step(:\n")
    (tmp_path / "plain.py").write_text("VALUE = 1\n")
    (tmp_path / "raises.py").write_text("def train_one_step():\n    pass\n\n\nVALUE = 1 / 0\n")
    with pytest.raises(SystemExit) as stop:
        main([a.format(tmp=tmp_path) for a in argv])
    err = capsys.readouterr().err.strip()
    said = said.format(tmp=tmp_path)
    assert stop.value.code == 2 and len(err.splitlines()) == 1 and err.startswith("error: ") and said in err, err
    assert "fastvideo/fastvideo" not in err


def _half_then_full(real_open):
    """open() whose files write half of what they are given, then fail as a full disk does."""
    class HalfFile:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, text):
            self.f.write(text[:len(text) // 2])
            self.f.flush()
            raise OSError(errno.ENOSPC, "No space left on device")
    return lambda *a, **kw: HalfFile(real_open(*a, **kw))


def test_a_full_disk_under_jagg_metrics_stops_with_nothing_torn(cache_dir, tmp_path, monkeypatch):
    """An earlier run's torn last line is dropped before this run's first record (which it would
    otherwise swallow); a full disk mid-line stops the step with DiskFullError (one line, exit 3 from
    the launcher) and leaves the file as it was before the line."""
    from dancegrpo.errors import DiskFullError
    from dancegrpo.utils import metrics
    from jagg_patch.tools.compare import load_metrics
    standin = Standin("flux", cache_dir, tmp_path)
    metrics_file = tmp_path / "out" / "jagg_metrics.jsonl"
    metrics_file.parent.mkdir()
    metrics_file.write_text('{"step": 1, "run_id": "earlier"}\n{"step": 2, "run_')   # killed mid-line
    apply(standin.module, window=3, jagg_frac=0.5, reuse="off", backward="split")
    try:
        standin.step()
        before = metrics_file.read_text()
        monkeypatch.setattr(metrics, "open", _half_then_full(open), raising=False)
        with pytest.raises(DiskFullError, match=r"no space left to write step 2's line of jagg_metrics.jsonl"):
            standin.step()
    finally:
        revert(standin.module)
    assert metrics_file.read_text() == before
    assert [r["step"] for r in read_jsonl(metrics_file)] == [1, 1]
    warnings_said = []
    assert [r["step"] for r in load_metrics(str(metrics_file.parent), warn=warnings_said.append)] == [1]
    assert not any("torn" in w for w in warnings_said), warnings_said
    source = open(os.path.join(ROOT, "jagg_patch", "upstream", "__main__.py")).read()
    assert "exit_on_config_error(main)()" in source.split('if __name__ == "__main__":')[1]


def test_a_resumed_upstream_auto_run_says_its_routing_starts_afresh(capsys):
    from jagg_patch.upstream.__main__ import jagg_parser, preflight
    flags = dict(use_group=True, train_batch_size=1, num_generations=4, gradient_accumulation_steps=4,
                 sampling_steps=8, timestep_fraction=0.6, h=64, w=64, clip_range=1e-4, adv_clip_max=5.0)
    jagg = jagg_parser().parse_args(["--jagg_frac", "auto", "--jagg_monitor_every", "5"])
    preflight(argparse.Namespace(**flags, resume_from_checkpoint=None), jagg, "flux")
    assert "starts its --jagg_frac auto routing afresh" not in capsys.readouterr().out
    preflight(argparse.Namespace(**flags, resume_from_checkpoint="checkpoint-40-0"), jagg, "flux")
    assert "a resumed upstream run starts its --jagg_frac auto routing afresh" in capsys.readouterr().out
