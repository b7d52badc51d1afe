"""2 CPU ranks under torchrun (gloo, FSDP1 or DeepSpeed): gradients and steps equal the
single-process ones. The checks live in tests/dist/ and run in one launch (the dist_result fixture)."""
import os

import pytest

from helpers import FAST, REPO_ROOT, dist_check, dist_id

JAGG_W4 = ["--apply_jagg", "--jagg_window", "4", "--jagg_frac", "1.0"]
LORA = ["--use_lora", "--lora_rank", "4", "--lora_alpha", "8"]
# The authors' variant (window grouping, index alpha, split backward)
AUTHORS = ["--apply_jagg", "--jagg_grouping", "window", "--jagg_alpha", "index", "--jagg_backward", "split",
           "--jagg_window", "3", "--jagg_frac", "1.0", "--timestep_fraction", "0.7"]


@pytest.mark.parametrize("dist_result", [dist_check("fsdp-plain", "grad", FAST),
                                         dist_check("fsdp-checkpointing", "grad", FAST + ["--gradient_checkpointing"])],
                         indirect=True, ids=dist_id)
def test_fsdp_two_ranks_gradient_equals_single_process(dist_result):
    result = dist_result
    assert result["world_size"] == 2
    assert result["ref_norm"] > 0
    assert result["rel_err"] < 1e-5, result
    # rank 0 trained 4 samples x 4 transitions; the hooks saw each backward once
    assert result["transformer_backwards"] == result["transformer_forwards_grad"] == 16
    assert_ratio_statistics_of_the_whole_batch(result)


def assert_ratio_statistics_of_the_whole_batch(result):
    """The PPO statistics each rank logs (its half, reduced over the ranks: sums, min, max) are those
    written out over the single process's whole batch (2 prompts x 4 samples x 4 transitions)."""
    reference = result["ratio_reference"]
    assert reference["count"] == 32 and reference["clip_frac"] > 0   # ratios spread past the clip (1e-4)
    for name, value in result["ratio_stats"].items():
        assert value == pytest.approx(reference[name], rel=1e-5, abs=1e-9), name


BF16 = ["--mixed_precision", "bf16"]


@pytest.mark.parametrize("dist_result,jagg,params", [
    (dist_check("fsdp-bf16", "grad", FAST + BF16), False, "fp32"),
    (dist_check("fsdp-bf16-jagg", "grad", FAST + BF16 + JAGG_W4), True, "fp32"),
    (dist_check("fsdp-bf16-params", "grad", FAST + BF16 + ["--master_weight_type", "bf16"]), False, "bf16")],
    indirect=["dist_result"], ids=["vanilla", "jagg", "bf16-params"])
def test_fsdp_two_ranks_compute_in_bf16_on_cpu(dist_result, jagg, params):
    """--mixed_precision bf16 under FSDP1 on gloo: the banner says so; the two ranks' gradient is the
    single-process bf16 one (fp32 FSDP weights under CPU autocast, as upstream's Flux: to float32
    reduction order), and it is not the float32 gradient (bf16 moved it). With --master_weight_type bf16
    (upstream's Qwen-Image setting: bf16 parameters and a bf16 gradient reduction, which gloo does) it
    is the bf16 gradient up to the bf16 rounding of the weights and of the reduction: closer to the
    single-process bf16 gradient than that is to float32's."""
    result = dist_result
    print(f"bf16 on 2 ranks ({params} FSDP weights): rel. error {result['rel_err']:.2e} against one process in "
          f"bf16, {result['rel_err_vs_float32']:.2e} against float32")
    assert result["world_size"] == 2 and "computes in bf16 autocast" in result["banner"]
    assert f"(FSDP {params})" in result["banner"]
    assert result["rel_err_vs_float32"] > 1e-3
    if params == "fp32":
        assert result["rel_err"] < 1e-5, result
    else:
        assert result["rel_err"] < 0.5 * result["rel_err_vs_float32"], result
    assert result["transformer_backwards"] == (8 if jagg else 16)
    assert_ratio_statistics_of_the_whole_batch(result)


@pytest.mark.parametrize("dist_result", [dist_check("fsdp-authors", "grad", FAST + AUTHORS)], indirect=True,
                         ids=dist_id)
def test_fsdp_two_ranks_window_split_equals_single_process(dist_result):
    """The authors' variant (window grouping, index alpha, split backward) under FSDP1."""
    result = dist_result
    assert result["world_size"] == 2 and result["ref_norm"] > 0
    assert result["rel_err"] < 1e-5, result
    # rank 0: 4 samples x 2 windows; each JAGG window (0 or 1) costs 2 backwards in 2 calls, window 2 one
    assert result["jagg_groups"] >= 1
    assert result["transformer_backwards"] == result["transformer_forwards_grad"] < 4 * 6


@pytest.mark.parametrize("dist_result,jagg", [(dist_check("fsdp-lora-vanilla", "grad", FAST + LORA), False),
                                              (dist_check("fsdp-lora-jagg", "grad", FAST + LORA + JAGG_W4), True)],
                         indirect=["dist_result"], ids=["vanilla", "jagg"])
def test_fsdp_two_ranks_lora_gradient_equals_single_process(dist_result, jagg):
    """--use_lora under FSDP1 (frozen base and trainable adapter in the same units): the adapter's
    gradient over two ranks equals the single-process one; only adapter tensors are compared."""
    result = dist_result
    assert result["world_size"] == 2 and result["ref_norm"] > 0
    assert result["rel_err"] < 1e-5, result
    # A and B of to_q, to_k, to_v, to_out.0 in the double block and to_q, to_k, to_v in the single
    # block (its attention has no to_out)
    assert result["num_trained_tensors"] == 2 * (4 + 3)
    assert result["transformer_backwards"] == (8 if jagg else 16)


FSDP2 = ["--engine", "fsdp2"]


@pytest.mark.parametrize("dist_result,jagg,lora", [
    (dist_check("fsdp2-plain", "grad", FAST + FSDP2), False, False),
    (dist_check("fsdp2-checkpointing-jagg", "grad", FAST + FSDP2 + ["--gradient_checkpointing"] + JAGG_W4), True,
     False),
    (dist_check("fsdp2-authors", "grad", FAST + FSDP2 + AUTHORS), True, False),
    (dist_check("fsdp2-lora-jagg", "grad", FAST + FSDP2 + LORA + JAGG_W4), True, True),
    (dist_check("fsdp2-bf16-jagg", "grad", FAST + FSDP2 + BF16 + JAGG_W4), True, False)],
    indirect=["dist_result"], ids=["vanilla", "checkpointing-jagg", "authors", "lora-jagg", "bf16-jagg"])
def test_fsdp2_two_ranks_gradient_equals_single_process(dist_result, jagg, lora):
    """--engine fsdp2 (fully_shard per block and on the root; DTensor parameters): the two ranks'
    gradient, gathered from the DTensor shards, equals the single-process one on the whole batch, for
    vanilla, the paper's JAGG (backward auto: batched on 2 ranks) under gradient checkpointing, the
    authors' variant (split), a LoRA adapter (frozen and trainable parameters in one unit), and bf16
    autocast over fp32 parameters (Flux's upstream setting). In bf16 the gradient is the single-process
    bf16 one to bf16's rounding (measured 6.0e-4, vanilla 6.8e-4, against 0.32 from float32's): FSDP2 hooks each unit's
    inputs with an autograd function, which changes the order in which autograd sums, in bf16, the
    gradient of a tensor every block uses (the time embedding: its parameters are the ones that
    differ, by about bf16's epsilon); FSDP1 hooks the flat parameters and leaves the order alone."""
    result = dist_result
    print(f"FSDP2 on 2 ranks: rel. error {result['rel_err']:.2e} against one process")
    assert result["world_size"] == 2 and result["ref_norm"] > 0 and "(FSDP2 fp32)" in result["banner"]
    if "rel_err_vs_float32" in result:
        assert result["rel_err"] < 2e-3 and result["rel_err"] < 0.01 * result["rel_err_vs_float32"], result
    else:
        assert result["rel_err"] < 1e-5, result
    if lora:
        assert result["num_trained_tensors"] == 2 * (4 + 3)
    assert (result["jagg_groups"] > 0) == jagg
    if result["ratio_reference"]["count"] == 32:   # the trained grouping's 4 transitions per sample
        assert_ratio_statistics_of_the_whole_batch(result)


CONFIGS = os.path.join(REPO_ROOT, "configs", "deepspeed")


def deepspeed(stage):
    return ["--engine", "deepspeed", "--deepspeed_config", os.path.join(CONFIGS, f"zero{stage}.json")]


@pytest.mark.parametrize("dist_result,stage,jagg", [
    (dist_check("zero2-vanilla", "deepspeed", FAST + deepspeed(2)), 2, False),
    (dist_check("zero3-jagg", "deepspeed", FAST + deepspeed(3) + JAGG_W4), 3, True)],
    indirect=["dist_result"], ids=["zero2-vanilla", "zero3-jagg"])
@pytest.mark.slow
def test_deepspeed_two_ranks_step_equals_single_process(dist_result, stage, jagg):
    """ZeRO-2 / ZeRO-3 on 2 CPU ranks (gloo): the weights after one optimizer step equal a
    single-process AdamW step on the whole batch (each stage with one update form; all four
    pairings measured: 6.2e-7 vanilla, 0 JAGG, both stages (float32 reduction order, amplified where Adam divides a tiny gradient by its own
    size); the step moves weights by 1e-2 (lr 1e-2). Tolerance 1e-5: 0.1% of the step."""
    result = dist_result
    print(f"ZeRO-{stage}: max |w - w_ref| {result['max_abs_err']:.2e}, moved {result['moved']:.2e}")
    assert result["world_size"] == 2 and result["stage"] == stage
    assert result["moved"] > 1e-4
    assert result["max_abs_err"] < 1e-5, result
    assert abs(result["grad_norm"] - result["ref_grad_norm"]) < 1e-5 * result["ref_grad_norm"]
    assert result["transformer_backwards"] == (8 if jagg else 16)   # rank 0: 4 samples


@pytest.mark.parametrize("dist_result", [dist_check("fsdp-comm", "comm", FAST + ["--jagg_window", "4"])],
                         indirect=True, ids=dist_id)
@pytest.mark.slow
def test_fsdp_joint_backward_gathers_each_unit_once_per_group(dist_result):
    """The paper's claim, counted: FSDP1 (FULL_SHARD, the trainer's wrapping) all-gathers a unit
    once per forward and once per backward CALL, so one JAGG group of 4 (one micro-batch of 4
    samples per rank) costs a block unit 4 forward gathers + 1 (joint) or + 2 (split), 2 + 1 / 2 + 2
    when the middles come from the rollout; batched forwards both endpoints in one call: 1 + 2 + 1,
    with reuse 1 + 1; vanilla 4 x (1 + 1). Every form's FSDP gradient equals the single-process one."""
    result = dist_result
    forms = result["forms"]
    assert result["world_size"] == 2 and result["samples_per_rank"] == 4
    block_units = ("transformer_blocks.0", "single_transformer_blocks.0")
    expected = {"vanilla": 8, "joint": 5, "split": 6, "batched": 4, "joint_reuse": 3, "split_reuse": 4,
                "batched_reuse": 2}
    for form, gathers in expected.items():
        assert [forms[form]["all_gathers"][u] for u in block_units] == [gathers, gathers], (form, forms[form])
    # one gradient reduce-scatter per unit (2 blocks + the root) per backward call
    calls = {"vanilla": 4, "joint": 1, "split": 2, "batched": 1, "joint_reuse": 1, "split_reuse": 2,
             "batched_reuse": 1}
    for form, n in calls.items():
        assert forms[form]["backward_calls"] == n and forms[form]["reduce_scatters"] == 3 * n, form
        assert forms[form]["rel_err"] < 1e-5, (form, forms[form]["rel_err"])
    assert all(forms[f]["forwards_reused"] == 2 * 4 for f in ("joint_reuse", "split_reuse", "batched_reuse"))


@pytest.mark.parametrize("dist_result", [dist_check("fsdp2-comm", "comm", FAST + ["--jagg_window", "4"] + FSDP2)],
                         indirect=True, ids=dist_id)
@pytest.mark.slow
def test_fsdp2_collectives_per_group_side_by_side_with_fsdp1(dist_result):
    """The same micro-batch as the FSDP1 count above, on fully_shard units (reshard after forward).
    FSDP2 runs a unit's pre-backward unshard once per forward graph, not once per backward call: the
    joint backward through both endpoints gathers a block unit twice, as split does (4 forward + 2),
    where FSDP1 gathers it once (4 + 1); it still reduce-scatters once per unit (FSDP2 accumulates the
    unsharded gradient until the call's end), where split reduce-scatters twice. Batched (both
    endpoints in one forward and one graph) is 4 on both engines, 2 with the middles reused. The root
    stays unsharded between its forward and backward. Every form's gradient is the single-process one."""
    result = dist_result
    forms = result["forms"]
    assert result["world_size"] == 2 and result["samples_per_rank"] == 4 and result["engine"] == "fsdp2"
    block_units = ("transformer_blocks.0", "single_transformer_blocks.0")
    expected = {"vanilla": 8, "joint": 6, "split": 6, "batched": 4, "joint_reuse": 4, "split_reuse": 4,
                "batched_reuse": 2}
    for form, gathers in expected.items():
        assert [forms[form]["all_gathers"][u] for u in block_units] == [gathers, gathers], (form, forms[form])
    root = {"vanilla": 8, "joint": 5, "split": 6, "batched": 4, "joint_reuse": 3, "split_reuse": 4, "batched_reuse": 2}
    assert {form: forms[form]["all_gathers"][""] for form in root} == root
    scatters = {"vanilla": 4, "joint": 1, "split": 2, "batched": 1, "joint_reuse": 1, "split_reuse": 2,
                "batched_reuse": 1}   # per unit (3 units)
    for form, n in scatters.items():
        assert forms[form]["reduce_scatters"] == 3 * n and forms[form]["backward_calls"] == n, form
        assert forms[form]["rel_err"] < 1e-5, (form, forms[form]["rel_err"])
