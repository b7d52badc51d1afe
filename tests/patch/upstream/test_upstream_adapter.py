"""jagg_patch.upstream on stand-ins of upstream's trainer files (tests/upstream_standin: upstream's
names, signatures, return values, inline update loop and __main__ parser, written from the
references, built on dancegrpo's SDE step and the tiny preset's models), in float64 on a one-rank
gloo group:
- exact mode reproduces the stand-in's own train_one_step (gradient at every optimizer step,
  returns, global RNG state afterwards), for the Flux, Flux LoRA and Qwen-Image signatures;
- JAGG equals jagg_patch's own JAGG on this project's trainer for the same rollout and trained
  transitions (both alpha rules, every backward form), and its pass counts are hook-counted;
- the fingerprint stops on a changed signature or rollout arity and warns on a changed body.
"""
import argparse
import copy
import dataclasses
import functools
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

from dancegrpo import trainer
from dancegrpo.models.flux import FluxFamily
from dancegrpo.models.qwenimage import QwenImageFamily
from dancegrpo.algo.sde import model_timesteps, sigma_schedule
from dancegrpo.build import TrainContext
from dancegrpo.engines import FSDPEngine
from jagg_patch import make_policy_update, make_window_selection
from jagg_patch.upstream import (UpstreamChanged, UpstreamSourceChanged, apply, fingerprint, load_trainer, revert,
                                 run_main_block, source_hash)
from jagg_patch.upstream.fingerprint import family_of
from helpers import REPO_ROOT, dist_check, dist_id

ROOT = REPO_ROOT
STANDIN = os.path.join(ROOT, "tests", "upstream_standin")
FILES = {"flux": "train_grpo_flux.py", "flux_lora": "train_grpo_flux_lora.py", "qwenimage": "train_grpo_qwenimage.py"}
B, GA = 4, 2   # one prompt x 4 generations per step; two optimizer steps per step


def standin_file(family):
    return os.path.join(STANDIN, "fastvideo", FILES[family])


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    """Upstream's step needs a process group (it all-gathers, all-reduces and waits at barriers)."""
    saved_path = list(sys.path)
    sys.path.insert(0, STANDIN)
    from fastvideo.utils.standin_setup import init_single_process_group
    init_single_process_group()
    yield
    import torch.distributed as dist
    dist.destroy_process_group()
    sys.path[:] = saved_path
    for name in [n for n in sys.modules if n == "fastvideo" or n.startswith("fastvideo.")]:
        del sys.modules[name]


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)   # upstream appends to ./reward.txt


class Standin:
    """A stand-in trainer module, its flags, one prompt batch, and a float64 transformer whose
    starting weights every `step` restores."""

    def __init__(self, family, cache_dir, tmp_path, *flags, transformer=None):
        from fastvideo.utils.standin_setup import add_lora, load_transformer, prompt_batches, standin_parser
        self.family = family
        self.module = load_trainer(standin_file(family))
        self.args = standin_parser().parse_args(
            ["--cache_dir", cache_dir, "--output_dir", str(tmp_path / "out"), "--use_group", "--num_generations",
             str(B), "--gradient_accumulation_steps", str(GA), "--clip_range", "0.05", "--max_grad_norm", "1e9",
             *map(str, flags)])
        kind = "qwenimage" if family == "qwenimage" else "flux"
        loaded, data_json = load_transformer(kind, cache_dir, torch.float64)
        self.transformer = transformer or loaded
        if family == "flux_lora":
            add_lora(self.transformer, 4).double()
        self.initial = copy.deepcopy(self.transformer.state_dict())
        self.batch = next(prompt_batches(kind, data_json, 1, torch.float64))

    def step(self, seed=7):
        """(returns, gradients at each optimizer step, global RNG state afterwards, weights afterwards)."""
        from fastvideo.utils.standin_setup import latent_reward
        torch.manual_seed(seed)
        self.transformer.load_state_dict(self.initial)
        self.transformer.zero_grad(set_to_none=True)
        trainable = [p for p in self.transformer.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=1e-3)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        grads = []
        optimizer.register_step_pre_hook(lambda *_: grads.append(grad_of(trainable)))
        common = (self.args, torch.device("cpu"), self.transformer, None, latent_reward, None, optimizer, scheduler)
        if self.family == "qwenimage":
            embeds, masks, caption, length = self.batch
            out = self.module.train_one_step(*common, embeds, masks, caption, length, None, self.args.max_grad_norm,
                                             None, None)
        else:
            tail = (None,) if self.family == "flux" else ()
            out = self.module.train_one_step(*common, iter([self.batch]), None, self.args.max_grad_norm, None, *tail)
        return out, grads, torch.get_rng_state(), flat(p.detach() for p in trainable)


def flat(tensors):
    return torch.cat([t.reshape(-1) for t in tensors]).clone()


def grad_of(params):
    """The flat gradient; a parameter the loss does not reach (Qwen-Image has some) counts as 0."""
    return flat(torch.zeros_like(p) if p.grad is None else p.grad for p in params)


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


# ---------------------------------------------------------------- loading and the launcher

def test_load_trainer_runs_the_definitions_not_the_main_block(monkeypatch):
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != STANDIN])
    module = load_trainer(standin_file("flux"))
    assert module.__name__ == "fastvideo.train_grpo_flux" and callable(module.train_one_step)
    assert "MAIN_BLOCK_RAN" not in vars(module)
    assert STANDIN in sys.path   # the checkout root: `fastvideo.*` imports resolve
    with pytest.raises(SystemExit) as stop:   # the block itself: upstream's inline parser
        run_main_block(module, ["--help"])
    assert stop.value.code == 0 and vars(module)["MAIN_BLOCK_RAN"]
    assert [family_of(load_trainer(standin_file(f))) for f in FILES] == list(FILES)


def launch(*argv, cwd, path=()):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([ROOT, *path]))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return subprocess.run([sys.executable, "-m", "jagg_patch.upstream", *map(str, argv)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def test_launcher_strips_the_jagg_flags_and_runs_upstreams_main(cache_dir, tmp_path):
    out = tmp_path / "run"
    # JAGG flags before the file and among upstream's: upstream's strict parser would refuse any of them.
    run = launch("--jagg_window", 4, "--jagg_frac", "auto", standin_file("flux"), "--cache_dir", cache_dir,
                 "--output_dir", out, "--use_group", "--num_generations", B, "--jagg_backward", "split",
                 "--gradient_accumulation_steps", B, "--max_train_steps", 2, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "JAGG plan (grouping trained, alpha timestep, backward split" in run.stdout
    assert "step 2 loss" in run.stdout   # upstream's own main ran its loop
    lines = [json.loads(line) for line in (out / "jagg_metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2] and lines[0]["run_id"] == lines[1]["run_id"]
    # --jagg_frac auto without --jagg_monitor_every: measured at step 1 (then every 10), routed from then on
    assert "measured with --jagg_monitor_every 10" in run.stdout and "step 1: JAGG routing (auto" in run.stdout
    assert "jagg_cos/g0" in lines[0] and "jagg_cos/g0" not in lines[1] and lines[0]["jagg_cos/g0"] >= 0.8
    assert [r["jagg_routed"] for r in lines] == [1, 1]
    # one group of 4 per sample: 2 backwards; the middles come from the rollout (all samples on-policy)
    assert all(r["transformer_backwards"] == 2 * B and r["transformer_forwards_reused"] == 2 * B for r in lines)
    assert len((tmp_path / "reward.txt").read_text().splitlines()) == 2


def test_launcher_stops_on_a_changed_upstream_before_loading_models(tmp_path):
    changed = write_changed(tmp_path, "flux", "def grpo_one_step(args, latents, pre_latents,",
                            "def grpo_one_step(args, latents, next_latents,")
    # The changed copy stands outside the stand-in checkout, whose `fastvideo` it imports.
    run = launch("--jagg_window", 4, changed, "--cache_dir", tmp_path, "--output_dir", tmp_path / "o", cwd=tmp_path,
                 path=[STANDIN])
    assert run.returncode == 2
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("error: upstream changed") and "grpo_one_step" in last and "next_latents" in last
    assert "--jagg_allow_upstream_changes" in last


# ---------------------------------------------------------------- exact mode == upstream's own step

@pytest.mark.parametrize("family", list(FILES))
def test_exact_mode_reproduces_upstreams_own_step(family, cache_dir, tmp_path):
    standin = Standin(family, cache_dir, tmp_path)
    (loss, norm), grads, rng, weights = standin.step()
    apply(standin.module, mode="exact")
    try:
        (loss2, norm2), grads2, rng2, weights2 = standin.step()
        stats = standin.module.train_one_step.last_stats
    finally:
        revert(standin.module)
    assert len(grads) == len(grads2) == B // GA
    assert all(rel(g2, g) < 1e-12 for g, g2 in zip(grads, grads2))   # measured ~1e-16
    assert torch.equal(rng, rng2)   # the same draws, in the same order
    # The loss is a sum of per-transition terms of either sign (~1e-2 each) that nearly cancel:
    # compared in absolute terms, to well below one term's float64 rounding times their number.
    assert abs(loss2 - loss) < 1e-14 and abs(norm2 - norm) <= 1e-12 * norm
    assert rel(weights2, weights) < 1e-12
    n = int((8 - 1) * 0.6)
    assert stats["transformer_forwards_grad"] == stats["transformer_backwards"] == B * n
    assert stats["transformer_forwards_nograd"] == B * 8   # the rollout
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


def recorded_rollout(module):
    """Wrap module.sample_reference_model: keep its result and the global RNG state right after it."""
    box = {}
    original = module.sample_reference_model

    @functools.wraps(original)
    def recording(*args, **kwargs):
        box["result"] = original(*args, **kwargs)
        box["rng"] = torch.get_rng_state()
        return box["result"]
    module.sample_reference_model = recording
    return box, original


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
    update = make_policy_update(4, 1.0, "jagg", alpha, backward, grouping, reuse="off")
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
    lines = [json.loads(line) for line in (tmp_path / "out" / "jagg_metrics.jsonl").read_text().splitlines()]
    assert {k: lines[0][k] for k in stats} == stats and lines[1]["reuse"] == "on_policy"


def test_the_monitor_measures_what_it_measures_on_this_trainer_and_leaves_the_step(cache_dir, tmp_path, make_args):
    """W 3 over 6 trained transitions (two positions), the monitor at every step: the adapter's step
    with it gives the gradients at every optimizer step, returns, RNG draws and pass counts of the
    step without it, bit for bit; its cosines are those jagg_patch's monitor measures on this
    project's trainer for the same rollout and transitions (each one's first micro-batch: sample 0)."""
    flags = ("--timestep_fraction", 0.9)   # int(7 * 0.9) = 6 trained transitions
    standin = Standin("flux", cache_dir, tmp_path, *flags)
    config = dict(window=3, jagg_frac=1.0, reuse="off", backward="split")
    try:
        apply(standin.module, **config)
        plain = standin.step()
        plain_stats = standin.module.train_one_step.last_stats
        box, original = recorded_rollout(standin.module)
        apply(standin.module, **config, monitor_every=1)
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
    update = make_policy_update(3, 1.0, "jagg", "timestep", "split", "trained", reuse="off", monitor_every=1,
                                monitor_samples=1)
    project = trainer.accumulate_policy_gradient(ctx, trainer.Rollout(all_latents, all_log_probs, [], rewards),
                                                 project_cond("flux", standin.batch), advantages, torch.arange(B),
                                                 steps, GA * 6, update).metrics
    measured = sorted(k for k in project if "/g" in k)
    assert len(measured) == 8 and measured == sorted(k for k in stats if "/g" in k)
    for key in measured:
        assert stats[key] == pytest.approx(project[key], rel=1e-10, abs=1e-12), key
    assert all(stats[f"jagg_relerr/g{p}"] > 1e-6 for p in range(2))   # W 3: JAGG is not exact here


@pytest.mark.parametrize("min_cos, fixed", [(-1.0, dict(jagg_frac=1.0)), (1.0, dict(mode="exact"))])
def test_auto_under_the_adapter_routes_by_the_threshold(cache_dir, tmp_path, min_cos, fixed):
    """--jagg_frac auto on the adapter: a threshold every cosine reaches routes both positions to JAGG,
    one none reaches (1.0; measured ~0.99) routes none; the step is the fixed configuration's, bit for bit."""
    standin = Standin("flux", cache_dir, tmp_path, "--timestep_fraction", 0.9)
    config = dict(window=3, reuse="off", backward="split")
    try:
        apply(standin.module, **config, jagg_frac="auto", monitor_every=1, min_cos=min_cos)
        auto = standin.step()
        stats = standin.module.train_one_step.last_stats
        apply(standin.module, **{**config, "jagg_frac": 1.0, **fixed})
        reference = standin.step()
    finally:
        revert(standin.module)
    assert stats["jagg_routed"] == (0b11 if min_cos < 0 else 0)
    assert all(torch.equal(a, b) for a, b in zip(auto[1], reference[1])) and torch.equal(auto[3], reference[3])


def test_a_rollout_that_does_not_match_its_latents_is_not_reused():
    from jagg_patch.upstream.rollout_record import RolloutRecorder
    model = torch.nn.Linear(3, 3)
    latents = torch.randn(2, 3, 4, 3)   # 2 samples, S = 2 transitions
    with RolloutRecorder(model) as recorder:
        for b in range(2):
            for k in range(2):
                model(latents[b:b + 1, k])
    assert torch.equal(recorder.outputs(latents)[1, 0], model(latents[1:2, 0]).detach()[0])
    with RolloutRecorder(model) as recorder:
        for b in range(2):
            for k in range(2):
                model(latents[b:b + 1, k] + (b == 1 and k == 1))   # one call fed something else
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

def write_changed(tmp_path, family, old, new):
    """A copy of a stand-in file with one edit, in a folder of its own."""
    folder = tmp_path / "changed"
    folder.mkdir(exist_ok=True)
    with open(standin_file(family)) as f:
        text = f.read()
    assert old in text
    path = folder / FILES[family]
    path.write_text(text.replace(old, new, 1))
    return path


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


def test_a_changed_body_warns_naming_the_function_and_runs(tmp_path):
    pristine = load_trainer(standin_file("qwenimage"))
    recorded = {("qwenimage", "train_one_step"): source_hash(pristine.train_one_step)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply(pristine, source_hashes=recorded)   # the recorded source: no warning
    revert(pristine)
    # A comment or layout change is not a change of the source.
    relaid = load_trainer(write_changed(tmp_path, "qwenimage", "    total_loss = 0.0\n",
                                        "    # upstream's running loss\n\n    total_loss = 0.0\n"))
    assert source_hash(relaid.train_one_step) == recorded[("qwenimage", "train_one_step")]
    changed = load_trainer(write_changed(tmp_path, "qwenimage", "    total_loss = 0.0\n", "    total_loss = 0.0 * 1\n"))
    with pytest.warns(UpstreamSourceChanged, match="train_one_step .*docs/upstream_adapter.md"):
        apply(changed, source_hashes=recorded)
    assert changed.train_one_step.jagg_family == "qwenimage"   # and it runs
    revert(changed)
    assert fingerprint(changed)["source_hashes"]["train_one_step"] != recorded[("qwenimage", "train_one_step")]


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
                              sampling_steps=8, timestep_fraction=0.6, h=64, w=64)
    with pytest.raises(SystemExit) as stop:
        preflight(qwen, jagg, "qwenimage")
    assert stop.value.code == 2 and "add --use_group" in capsys.readouterr().err
    flux = argparse.Namespace(**{**vars(qwen), "use_group": True, "train_batch_size": 1, "num_generations": 2})
    with pytest.raises(SystemExit):
        preflight(flux, jagg, "flux")   # GA 4 > 2 samples per rank: no optimizer step would run
    assert "--gradient_accumulation_steps 4 exceeds the 2 samples" in capsys.readouterr().err
    preflight(argparse.Namespace(**{**vars(flux), "num_generations": 4}), jagg, "flux")
    assert "JAGG plan" in capsys.readouterr().out


def test_fingerprint_command_prints_what_to_record(capsys):
    from jagg_patch.upstream.__main__ import main
    assert main(["--jagg_fingerprint", standin_file("flux_lora")]) == 0
    printed = capsys.readouterr().out
    module = load_trainer(standin_file("flux_lora"))
    assert "'family': 'flux_lora'" in printed and source_hash(module.train_one_step) in printed
    assert "'pre_latents'" in printed


# ---------------------------------------------------------------- FSDP, as upstream wraps its transformer

@pytest.mark.parametrize("dist_result", [dist_check("upstream-fsdp", "upstream")], indirect=True,
                         ids=dist_id)
def test_two_fsdp_ranks_exact_and_jagg(dist_result):
    """tests/dist/upstream_fsdp_check.py on two ranks: exact mode == the stand-in's own step under
    FSDP1 (measured 1.1e-7, float32), and JAGG with backward auto (batched on 2 ranks, one backward
    call per group) and rollout reuse == the mean over ranks of float64 single-process JAGG gradients
    (measured 2.1e-6: FSDP computes in float32)."""
    result = dist_result
    assert result["world_size"] == 2 and result["same_names"] and result["ref_norm"] > 0
    assert result["rel_exact"] < 1e-5 and result["rel_jagg"] < 1e-5, result
    stats = result["stats"]
    assert stats["backward_calls"] == B and stats["transformer_backwards"] == 2 * B
    assert stats["transformer_forwards_reused"] == 2 * B and stats["jagg_groups"] == B
