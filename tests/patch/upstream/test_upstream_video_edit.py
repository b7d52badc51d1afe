"""jagg_patch.upstream on upstream's Qwen-Image-Edit and Wan 2.1 trainers (stand-ins on a tiny
diffusers QwenImageTransformer2DModel with a condition image and a tiny WanTransformer3DModel with 2
frames, float64, one rank): JAGG W 4 == an independent float64 reference built from each stand-in's
own grpo_one_step (Wan with classifier-free guidance, whose doubled call's rows the batched backward
splits, and without; with and without --use_group), exact mode == the stand-in's own step where the
adapter module does not check it, the counts, rollout reuse of the raw (doubled, condition-token)
outputs, and the checks that tell these trainers apart or refuse bad input before the rollout."""

import pytest
import torch

from jagg_patch.upstream import apply, load_trainer, revert
from jagg_patch.upstream.fingerprint import family_of
from upstream_harness import (B, GA, Standin, copy_checkout, in_tmp, jagg_step_and_its_draw,  # noqa: F401
                              one_rank_group, recorded_rollout, standins_known, reference_jagg_gradient, rel, standin_file)

pytestmark = pytest.mark.filterwarnings("ignore::jagg_patch.upstream.UpstreamSourceChanged")
S, N = 8, 4   # sampling steps; trained transitions per sample (int(7 * 0.6))


def upstream_advantages(rewards, grouped):
    r = rewards.float()
    if not grouped:
        return (r - r.mean()) / (r.std() + 1e-8)
    r = r.reshape(-1, B)
    return ((r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + 1e-8)).reshape(-1)


# Wan's blocks compute their modulation in float32 (diffusers casts with .float()), so where the two
# endpoints share one graph (batched) a parameter's gradient is summed over them in float32 first.
CASES = [("qwenimage_edit", (), True, "joint", "timestep", 1e-10),
         ("qwenimage_edit", (), True, "batched", "index", 1e-10),
         ("wan", (), True, "joint", "timestep", 1e-10),
         ("wan", (), True, "batched", "timestep", 1e-8),   # measured 2.2e-9: the float32 sums above
         ("wan", ("--cfg_infer", 1.0), True, "split", "index", 1e-10),
         ("wan", (), False, "joint", "timestep", 1e-10),
         ("wan", ("--cfg_infer", 1.0), False, "batched", "timestep", 1e-8)]   # measured 2.3e-10


@pytest.mark.parametrize("key, flags, grouped, backward, alpha, tolerance", CASES,
                         ids=[f"{k}-{'cfg1' if f else 'cfg5' if k == 'wan' else 'cond'}-{'group' if g else 'nogroup'}-"
                              f"{b}-{a}" for k, f, g, b, a, _ in CASES])
def test_jagg_equals_the_independent_reference(key, flags, grouped, backward, alpha, tolerance, cache_dir, tmp_path):
    """W 4 over each sample's 4 trained transitions (one group), GA B (one optimizer step)."""
    standin = Standin(key, cache_dir, tmp_path, "--gradient_accumulation_steps", B, *flags, group=grouped)
    adapter_grad, stats, result, steps = jagg_step_and_its_draw(standin, N, window=4, jagg_frac=1.0,
                                                                backward=backward, alpha=alpha, reuse="off")
    reference = reference_jagg_gradient(standin, result, steps, upstream_advantages(result[0], grouped), B * N,
                                        alpha)
    assert rel(adapter_grad, reference) < tolerance
    assert (stats["jagg_groups"], stats["transformer_backwards"], stats["transformer_forwards_grad"]) == (B, 2 * B,
                                                                                                         2 * B)
    # one transformer call per rollout step and per member, whatever its rows (a guided call holds 2 per sample)
    assert stats["transformer_forwards_nograd"] == B * S + B * (N - 2)


@pytest.mark.parametrize("flags, grouped", [(("--cfg_infer", 1.0), True), ((), False)], ids=["cfg1", "nogroup"])
def test_wan_exact_mode_is_its_own_step_unguided_and_without_groups(flags, grouped, cache_dir, tmp_path):
    standin = Standin("wan", cache_dir, tmp_path, *flags, group=grouped)
    ((loss, norm), grads, rng, weights), ((loss2, norm2), grads2, rng2, weights2), _ = standin.own_and_exact_steps()
    assert len(grads2) == B // GA and all(rel(g2, g) < 1e-12 for g, g2 in zip(grads, grads2))
    assert torch.equal(rng, rng2) and abs(loss2 - loss) < 1e-14 and abs(norm2 - norm) <= 1e-12 * norm


@pytest.mark.parametrize("key", ["qwenimage_edit", "wan"])
def test_rollout_reuse_takes_the_raw_outputs_and_gives_the_recomputed_gradient(key, cache_dir, tmp_path):
    """The recorded outputs hold the condition image's tokens (Edit) or both halves of the guided call,
    laid out per sample from the rollout's chunks of 2 (Wan): the gradient is the recomputed one."""
    standin = Standin(key, cache_dir, tmp_path)
    results, stats = {}, {}
    try:
        for reuse in ("off", "on_policy"):
            apply(standin.module, window=4, jagg_frac=1.0, reuse=reuse, backward="joint")
            results[reuse] = standin.step()
            stats[reuse] = standin.module.train_one_step.last_stats
    finally:
        revert(standin.module)
    assert stats["off"]["transformer_forwards_reused"] == 0
    assert stats["on_policy"]["transformer_forwards_reused"] == 2 * GA   # the samples before the first step
    assert stats["on_policy"]["transformer_forwards_nograd"] == stats["off"]["transformer_forwards_nograd"] - 2 * GA
    assert all(rel(a, b) < 1e-12 for a, b in zip(results["on_policy"][1], results["off"][1]))


def test_the_trainers_are_told_apart_and_the_others_refused_in_one_line(tmp_path):
    root = copy_checkout(tmp_path / "checkout")
    assert family_of(load_trainer(standin_file("qwenimage_edit", root))) == "qwenimage_edit"   # Qwen's, plus three
    assert family_of(load_trainer(standin_file("wan", root))) == "wan"
    assert family_of(load_trainer(standin_file("hunyuan", root))) == "hunyuan"   # its parameters, not Flux's loader
    assert family_of(load_trainer(standin_file("skyreels", root))) == "skyreels_i2v"
    other = tmp_path / "checkout" / "fastvideo" / "train_grpo_other.py"
    other.write_text("def train_one_step(args, transformer, batch):\n    pass\n")
    module = load_trainer(other)   # of no family the restated step is written for: its own step, deferred
    assert apply(module) is None and module.train_one_step.jagg_update == "deferred"
    assert "none of the trainers the adapter restates" in module.train_one_step.jagg_trainer.unknown
    revert(module)


def test_wan_refuses_a_negative_prompt_without_a_row_per_sample_before_the_rollout(cache_dir, tmp_path):
    standin = Standin("wan", cache_dir, tmp_path)
    prompt, negative, caption = standin.batch
    standin.batch = (torch.cat([prompt, prompt]), negative, caption * 2)   # 2 prompts, 1 negative row
    box, original = recorded_rollout(standin.module)
    apply(standin.module)
    try:
        with pytest.raises(ValueError, match="negative_prompt_embeds with 4 rows for 8 samples"):
            standin.step()
    finally:
        revert(standin.module)
        standin.module.sample_reference_model = original
    assert box == {}   # no rollout ran


def test_the_launcher_refuses_missing_flags_and_wan_without_cfg_infer_before_main(capsys):
    import argparse
    from jagg_patch.upstream.__main__ import jagg_parser, preflight
    args = argparse.Namespace(use_group=True, train_batch_size=1, num_generations=4, gradient_accumulation_steps=4,
                              sampling_steps=8, timestep_fraction=0.6, h=32, w=32, clip_range=1e-4)
    with pytest.raises(SystemExit) as stop:   # a parser without a flag the restated step reads
        preflight(args, jagg_parser().parse_args([]), "wan")
    assert stop.value.code == 2 and "upstream's parser gave no --adv_clip_max" in capsys.readouterr().err
    args.adv_clip_max = 5.0
    with pytest.raises(SystemExit) as stop:
        preflight(args, jagg_parser().parse_args([]), "wan")
    assert stop.value.code == 2 and "--cfg_infer" in capsys.readouterr().err
    preflight(argparse.Namespace(**vars(args), cfg_infer=5.0), jagg_parser().parse_args([]), "wan")
    plan = capsys.readouterr().out
    assert "JAGG plan" in plan and "not set by the flags alone" in plan   # video outputs: no MiB claimed
    assert "timestep alpha: from the integers int(sigma * 1000) Wan's model gets, in float64" in plan
