"""The PPO statistics of a step (dancegrpo.algo.ratio_stats): equal to a float64 computation written
out here over the trained transitions, one record per (sample, transition) whatever the update form,
none of the JAGG monitor's; and a run whose later GA blocks are off-policy logs what its ratios did."""
import math

import pytest
import torch

from dancegrpo import trainer
from dancegrpo.algo.grpo import choose_train_steps, policy_update as vanilla_update
from dancegrpo.algo.ratio_stats import FIELDS, RatioMeter
from jagg_patch import make_policy_update

from helpers import FAST, float64_setup, read_metrics, reference_log_prob, reference_step_velocity, run_main

TRAINED = 6


def _reference(ctx, rollout, cond, args, steps, clip_range):
    ratios, kls = [], []
    with torch.no_grad():
        for b in range(steps.shape[0]):
            for k in steps[b].tolist():
                v = reference_step_velocity(ctx.raw_transformer, rollout, cond, b, k, ctx.sigmas, args)
                d = float(reference_log_prob(v, rollout, b, k, ctx.sigmas, args) - rollout.log_probs[b, k])
                ratios.append(math.exp(d))
                kls.append(0.5 * d * d)
    return dict(ratio_mean=sum(ratios) / len(ratios), ratio_min=min(ratios), ratio_max=max(ratios),
                clip_frac=sum(abs(r - 1) > clip_range for r in ratios) / len(ratios),
                approx_kl=sum(kls) / len(kls)), len(ratios)


@pytest.mark.parametrize("update", ["vanilla", "jagg_split_monitored", "jagg_batched_reuse"])
def test_the_step_statistics_equal_a_float64_computation(make_args, update):
    """Old log-probs spread by 0.1 around the new ones (float64_setup) at clip range 0.05: some ratios
    outside the clip. JAGG scores each member once (its upstream gradient), the endpoints too; its
    monitor's scorings are a measurement's and stay out."""
    args, ctx, cond, rollout, adv = float64_setup(make_args, 4, "--timestep_fraction", "0.9")
    n = adv.numel()
    steps = choose_train_steps(n, args.sampling_steps - 1, TRAINED, torch.Generator().manual_seed(3))
    if update == "jagg_batched_reuse":
        from helpers import keep_rollout_outputs
        keep_rollout_outputs(ctx, rollout, cond)
    policy_update = {"vanilla": vanilla_update,
                     "jagg_split_monitored": make_policy_update(window=3, jagg_frac=1.0, backward="split",
                                                                monitor_every=1, monitor_samples=2),
                     "jagg_batched_reuse": make_policy_update(window=3, jagg_frac=1.0, backward="batched",
                                                              reuse="on_policy")}[update]
    ctx.ratio_meter = RatioMeter(keep=True)
    ctx.step = 1
    stats = trainer.accumulate_policy_gradient(ctx, rollout, cond, adv, torch.arange(n), steps, 8 * TRAINED,
                                               policy_update, on_policy=True)
    expected, count = _reference(ctx, rollout, cond, args, steps, args.clip_range)
    got = ctx.ratio_meter.summary(ctx.device)
    assert sum(ratios.numel() for _, _, ratios in ctx.ratio_meter.kept) == count == n * TRAINED
    assert sorted((int(s), int(k)) for samples, ks, _ in ctx.ratio_meter.kept for s, k in zip(samples, ks)) == \
        sorted((b, k) for b in range(n) for k in steps[b].tolist())   # each trained pair once
    assert 0 < expected["clip_frac"] < 1
    for name in FIELDS:
        assert got[name] == pytest.approx(expected[name], rel=1e-6, abs=1e-12), name
    if update == "jagg_split_monitored":
        assert any(key.startswith("jagg_cos/") for key in stats.metrics)   # the monitor did measure
    ctx.counter.remove()


def test_an_off_policy_block_logs_ratios_away_from_one(cache_dir, tmp_path):
    """GA half the samples: the second block trains after an optimizer step, so its ratios leave 1
    (lr 1e-2 on the tiny preset); the first block's are 1 exactly, so the range holds 1."""
    out = tmp_path / "run"
    assert run_main("dancegrpo.train_grpo_flux", "--preset", "tiny", "--cache_dir", cache_dir, "--output_dir", out,
                    *FAST, "--gradient_accumulation_steps", 4, "--learning_rate", "1e-2", "--max_train_steps", 1) == 0
    (record,) = read_metrics(out)
    assert record["optimizer_steps"] == 2
    assert record["ratio_min"] <= 1 <= record["ratio_max"]   # the first block's are 1 exactly
    assert (record["ratio_min"] < 1 or record["ratio_max"] > 1) and record["approx_kl"] > 0
    assert record["ratio_min"] <= record["ratio_mean"] <= record["ratio_max"]
    assert 0 < record["clip_frac"] <= 0.5   # only the second half can leave the clip range
