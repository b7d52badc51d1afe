"""--mixed_precision, decided in dancegrpo.utils.precision: what each device computes in, the
autocast it enters, the decode context, the banner's words, and the refusals (fp16 without a GPU)."""
import pytest
import torch

from dancegrpo.utils.precision import (bytes_per_output, compute_autocast, compute_dtype, decode_context,
                                       describe_precision)
from dancegrpo.utils.fsdp_util import resolve_weight_type

from helpers import FAST, run_main


@pytest.mark.parametrize("device,flag,expected", [
    ("cpu", None, None), ("cpu", "no", None), ("cpu", "bf16", torch.bfloat16),
    ("cuda", None, torch.bfloat16), ("cuda", "bf16", torch.bfloat16), ("cuda", "fp16", torch.float16),
    ("cuda", "no", None)])
def test_each_device_computes_in_the_dtype_the_flag_says(device, flag, expected):
    assert compute_dtype(device, flag) == expected
    assert describe_precision(device, flag) == {None: "float32", torch.bfloat16: "bf16 autocast",
                                                torch.float16: "fp16 autocast"}[expected]
    assert bytes_per_output(device == "cuda", flag) == (4 if expected is None else 2)


def test_cpu_autocast_runs_matmuls_in_bf16_only_when_asked():
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    with compute_autocast("cpu", "bf16"):
        assert (x @ w).dtype == torch.bfloat16
    for flag in (None, "no"):
        with compute_autocast("cpu", flag):
            assert (x @ w).dtype == torch.float32
    with decode_context("cpu", "bf16"):
        assert (x @ w).dtype == torch.bfloat16 and not torch.is_grad_enabled()
    with decode_context("cpu"):
        assert (x @ w).dtype == torch.float32


def test_fp16_needs_a_gpu():
    with pytest.raises(ValueError, match="fp16 needs a GPU"):
        compute_dtype("cpu", "fp16")


def test_fsdp_weights_follow_the_precision_on_cpu():
    """A CPU run in bf16 takes the family's upstream FSDP dtype (Qwen-Image bf16, gloo reduces bf16);
    a float32 CPU run stays fp32; the flag wins."""
    assert resolve_weight_type(None, "bf16", "cpu", "bf16") == "bf16"
    assert resolve_weight_type(None, "fp32", "cpu", "bf16") == "fp32"
    assert resolve_weight_type(None, "bf16", "cpu", None) == "fp32"
    assert resolve_weight_type("fp32", "bf16", "cpu", "bf16") == "fp32"


def test_fp16_on_cpu_is_refused_in_one_line_before_any_work(cache_dir, tmp_path, capsys):
    code = run_main("dancegrpo.train_grpo_flux", "--preset", "tiny", "--cache_dir", cache_dir,
                    "--output_dir", tmp_path / "run", *FAST, "--max_train_steps", 1, "--mixed_precision", "fp16")
    err = capsys.readouterr().err
    assert code == 2 and "--mixed_precision fp16 needs a GPU" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def _weights(folder):
    from safetensors.torch import load_file
    return load_file(str(folder / "checkpoint-1-0" / "diffusion_pytorch_model.safetensors"))


RUNS = {"vanilla": ("dancegrpo.train_grpo_flux",),
        "jagg": ("jagg_patch", "dancegrpo.train_grpo_flux", "--jagg_window", 4, "--jagg_frac", 1),
        "lora": ("dancegrpo.train_grpo_flux", "--use_lora", "--lora_rank", 4, "--lora_alpha", 8)}


@pytest.mark.parametrize("kind", sorted(RUNS))
def test_a_cpu_run_in_bf16_computes_in_bf16_and_logs_the_ratio_statistics(cache_dir, tmp_path, capsys, kind):
    """One step in float32 and in bf16 from the same weights and seed: the banner says which, the weights
    (the LoRA adapter) after the step differ, and every record holds the PPO statistics. GA covers the
    rollout, so the whole update is on-policy: the ratio is exactly 1 in both precisions (the update
    recomputes the rollout's outputs bit for bit: bf16 on this CPU does not depend on the batch shape)."""
    from dancegrpo.algo.ratio_stats import FIELDS
    from helpers import read_metrics
    from dancegrpo.adapters.lora import LoraWeights
    found = {}
    for precision in ("no", "bf16"):
        out = tmp_path / precision
        assert run_main(*RUNS[kind], "--preset", "tiny", "--cache_dir", cache_dir, "--output_dir", out, *FAST,
                        "--max_train_steps", 1, "--mixed_precision", precision) == 0
        banner = capsys.readouterr().out
        assert f"computes in {'bf16 autocast' if precision == 'bf16' else 'float32'}" in banner
        (record,) = read_metrics(out)
        assert set(FIELDS) <= set(record)
        assert (record["ratio_min"], record["ratio_max"], record["clip_frac"], record["approx_kl"]) == (1, 1, 0, 0)
        found[precision] = (LoraWeights.read_state(str(out / "checkpoint-1-0")) if kind == "lora"
                            else _weights(out))
    a, b = found["no"], found["bf16"]
    assert set(a) == set(b) and any(not torch.equal(a[k], b[k]) for k in a)
