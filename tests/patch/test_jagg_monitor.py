"""The live fidelity monitor (--jagg_monitor_every): its cosines and relative errors against a
float64 computation written out here (exact group gradient, JAGG's interpolated Jacobians, the
endpoints ablation), its pass counts, and that a run with it trains bit for bit as without it."""
import json
import os

import pytest
import torch

from dancegrpo import trainer
from dancegrpo.algo.grpo import choose_train_steps
from jagg_patch import make_policy_update

import helpers
from helpers import float64_setup, reference_step_loss, reference_step_velocity, reference_t, run_main

WINDOW, TRAINED, MONITORED = 3, 6, 2   # S 8: 7 transitions, 6 trained -> two positions of W 3


def _grad(model, loss):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params, retain_graph=True)])


def _reference(ctx, rollout, cond, adv, args, b, members, normaliser):
    """(exact, JAGG, endpoints) gradients of sample b's group `members`, float64, no JAGG code."""
    model, sigmas = ctx.raw_transformer, ctx.sigmas

    def velocity(k):
        return reference_step_velocity(model, rollout, cond, b, k, sigmas, args)

    def loss(k, v):
        return reference_step_loss(v, rollout, b, k, adv, sigmas, args) / normaliser
    v = [velocity(k) for k in members]
    exact = _grad(model, sum(loss(k, vk) for k, vk in zip(members, v)))
    # The model timesteps as the trainer holds them (float32): alpha is taken from those values.
    t = [float(torch.tensor(reference_t(float(sigmas[k])), dtype=torch.float32)) for k in members]
    alpha = [(t[0] - tj) / (t[0] - t[-1]) for tj in t]
    s = []
    for k, vk in zip(members, v):
        proxy = vk.detach().requires_grad_(True)
        s.append(torch.autograd.grad(loss(k, proxy), proxy)[0])
    jagg = _grad(model, sum((1 - a) * (v[0] * sj).sum() + a * (v[-1] * sj).sum() for a, sj in zip(alpha, s)))
    w = len(members)
    ends = _grad(model, (w / 2) * (loss(members[0], v[0]) + loss(members[-1], v[-1])))
    return exact, jagg, ends


def _cos_rel(exact, approx):
    return float(exact @ approx / (exact.norm() * approx.norm())), float((approx - exact).norm() / exact.norm())


def test_the_monitors_cosines_equal_a_float64_computation_and_leave_the_gradient(make_args):
    args, ctx, cond, rollout, adv = float64_setup(make_args, 4, "--timestep_fraction", "0.9")
    n = rollout.latents.shape[0]
    steps = choose_train_steps(n, args.sampling_steps - 1, TRAINED, torch.Generator().manual_seed(3))
    idx, normaliser = torch.arange(4), 8 * TRAINED
    ctx.step = 1

    def update(monitor_every):
        ctx.optimizer.zero_grad(set_to_none=True)
        stats = make_policy_update(window=WINDOW, jagg_frac=1.0, monitor_every=monitor_every, monitor_samples=MONITORED)(
            trainer.make_update_batch(ctx, rollout, cond, adv, idx, steps[idx], normaliser, True))
        return stats, [p.grad.clone() for p in ctx.raw_transformer.parameters() if p.requires_grad]
    plain_stats, plain = update(0)
    stats, monitored = update(1)
    assert all(torch.equal(a, b) for a, b in zip(plain, monitored))   # the update's gradient, bit for bit
    assert stats.loss == plain_stats.loss and not plain_stats.metrics
    for position in range(TRAINED // WINDOW):
        found = {f"{m}_{q}": [] for m in ("jagg", "endpoints") for q in ("cos", "relerr")}
        for b in range(MONITORED):
            members = sorted(steps[b].tolist())[position * WINDOW:(position + 1) * WINDOW]
            exact, jagg, ends = _reference(ctx, rollout, cond, adv, args, b, members, normaliser)
            for mode, approx in (("jagg", jagg), ("endpoints", ends)):
                cos, rel = _cos_rel(exact, approx)
                found[f"{mode}_cos"].append(cos)
                found[f"{mode}_relerr"].append(rel)
        for name, values in found.items():
            assert stats.metrics[f"{name}/g{position}"] == pytest.approx(sum(values) / len(values), abs=1e-9), \
                (name, position)
    assert all(stats.metrics[f"jagg_relerr/g{p}"] > 1e-3 for p in range(2))   # W 3 on this model: not exact


def _records(folder):
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


VARIANTS = {  # name: flags; W 2 on the first (JAGG is exact there: cos 1, and the pass counts by hand)
    "trained-w2": ["--jagg_window", 2, "--jagg_frac", 1],
    "window-index-batched": ["--jagg_window", 3, "--jagg_frac", 1, "--jagg_grouping", "window", "--jagg_alpha", "index",
                             "--jagg_backward", "batched"],
    "lora-auto-joint": ["--jagg_window", 3, "--jagg_frac", "auto", "--jagg_backward", "joint", "--use_lora",
                        "--lora_rank", 4, "--lora_alpha", 8, "--learning_rate", "1e-3"],
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_monitored_run_trains_bit_for_bit_as_without_and_counts_its_passes_apart(cache_dir, tmp_path, variant):
    from safetensors.torch import load_file
    from helpers import FAST
    run = ["jagg_patch", "dancegrpo.train_grpo_flux", "--preset", "tiny", "--cache_dir", cache_dir, *FAST,
           "--max_train_steps", 3, *VARIANTS[variant]]
    if variant == "lora-auto-joint":   # auto routes by the monitor: its run without one is the routing it chose
        return _auto_equals_its_routing(run, tmp_path)
    assert run_main(*run, "--output_dir", tmp_path / "plain") == 0
    assert run_main(*run, "--output_dir", tmp_path / "monitored", "--jagg_monitor_every", 2,
                    "--jagg_monitor_samples", MONITORED) == 0
    plain, monitored = _records(tmp_path / "plain"), _records(tmp_path / "monitored")
    same = ("reward_mean", "loss", "grad_norm", "transformer_forwards_grad", "transformer_forwards_nograd",
            "transformer_backwards", "transformer_forwards_reused", "jagg_groups", "activation_peak_mb")
    assert [[r[k] for k in same] for r in plain] == [[r[k] for k in same] for r in monitored]
    a, b = (load_file(str(tmp_path / name / "checkpoint-3-0" / "diffusion_pytorch_model.safetensors"))
            for name in ("plain", "monitored"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    measured = [any(k.startswith("jagg_cos/g") for k in r) for r in monitored]
    assert measured == [True, True, False]   # steps 1 and 2 (every 2)
    if variant != "trained-w2":
        return
    # 4 trained transitions in 2 groups of W 2, on 2 samples: exact 2 + JAGG 2 + endpoints 2 forwards
    # with grad per group, backwards 2 + 2 + 2.
    assert monitored[0]["monitor_forwards"] == MONITORED * 2 * 6 and monitored[0]["monitor_backwards"] == MONITORED * 2 * 6
    assert monitored[0]["jagg_cos/g0"] == pytest.approx(1.0, abs=1e-6)   # W 2: JAGG is exact
    assert monitored[0]["monitor_time_s"] > 0 and "monitor_forwards" not in plain[0]


@pytest.mark.parametrize("dist_result", [helpers.dist_check("fsdp-monitor", "monitor")], indirect=True,
                         ids=helpers.dist_id)
def test_under_fsdp_the_monitor_measures_the_full_gradient_and_leaves_the_update(dist_result):
    """tests/dist/fsdp_monitor_check.py, two ranks: each rank's cosines equal those of the full
    gradient (the ranks' samples averaged, computed in one process), float32; the update's gradient
    shards are bit for bit those without the monitor."""
    assert dist_result["world_size"] == 2
    for rank in dist_result["ranks"]:
        assert rank["same_update"]
        assert set(rank["measured"]) == set(rank["reference"]) and len(rank["reference"]) == 8
        for name, value in rank["reference"].items():
            assert rank["measured"][name] == pytest.approx(value, abs=2e-5), name


@pytest.mark.parametrize("dist_result", [helpers.dist_check(f"zero{stage}-monitor", "deepspeed_monitor", [stage])
                                         for stage in (2, 3)], indirect=True, ids=helpers.dist_id)
@pytest.mark.slow
def test_under_deepspeed_the_monitor_measures_the_full_gradient_and_leaves_the_step(dist_result):
    """tests/dist/deepspeed_monitor_check.py, two ranks, ZeRO-2 and ZeRO-3: each rank's cosines equal
    those of the full gradient computed in one process, float32; one optimizer step after the
    monitored update leaves the weights of the step without the monitor, bit for bit."""
    assert dist_result["world_size"] == 2
    for rank in dist_result["ranks"]:
        assert rank["same_step"] and rank["moved"] > 0
        assert set(rank["measured"]) == set(rank["reference"]) and len(rank["reference"]) == 8
        for name, value in rank["reference"].items():
            assert rank["measured"][name] == pytest.approx(value, abs=2e-5), name


def _auto_equals_its_routing(run, tmp_path):
    """--jagg_frac auto on a LoRA run: the routing it logs is that of the fixed fraction that routes the
    same positions, and the run with that fraction ends on the same adapter, bit for bit."""
    from dancegrpo.adapters.lora import LoraWeights
    # The measurement within the first micro-batch (FAST's 4 samples): the routing applies to the whole step.
    assert run_main(*run, "--output_dir", tmp_path / "auto", "--jagg_monitor_every", 2,
                    "--jagg_monitor_samples", 4) == 0
    records = _records(tmp_path / "auto")
    masks = {r["jagg_routed"] for r in records}
    assert len(masks) == 1 and "jagg_cos/g0" in records[0]   # one routing, chosen at step 1
    (mask,) = masks
    routed = [p for p in range(2) if mask >> p & 1]   # 4 trained transitions, W 3: groups of 3 and 1
    fixed = {(): 0.0, (0,): 1.0, (0, 1): 1.0}[tuple(routed)]
    assert run_main(*[a if a != "auto" else fixed for a in run], "--output_dir", tmp_path / "fixed") == 0
    a, b = (LoraWeights.read_state(str(tmp_path / name / "checkpoint-3-0")) for name in ("auto", "fixed"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [r["transformer_backwards"] for r in records] == [r["transformer_backwards"]
                                                            for r in _records(tmp_path / "fixed")]
