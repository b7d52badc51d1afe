"""The tiny preset end to end: metrics, counts, checkpoints, resume, bad input."""
import math
import os

import pytest
import torch
from safetensors.torch import load_file

from dancegrpo import train_grpo_flux
from dancegrpo.errors import ConfigError, MissingFileError

from helpers import FAST, read_metrics, run_main

KEYS = ["step", "reward_mean", "reward_std", "loss", "grad_norm", "lr", "step_time_s", "rollout_time_s",
        "update_time_s", "transformer_forwards_grad", "transformer_forwards_nograd", "transformer_backwards"]


def test_tiny_preset_end_to_end(make_args):
    args = make_args(*FAST, "--max_train_steps", 2, "--checkpointing_steps", 1)
    train_grpo_flux.main(args)
    records = read_metrics(args.output_dir)
    assert [r["step"] for r in records] == [1, 2]
    samples, S, n_train = 8, args.sampling_steps, 4   # int((8 - 1) * 0.6) = 4
    for r in records:
        for key in KEYS:
            assert key in r and math.isfinite(r[key]), key
        assert r["samples"] == samples
        assert r["transformer_forwards_nograd"] == samples * S          # the rollout
        assert r["transformer_forwards_grad"] == samples * n_train       # one per trained transition
        assert r["transformer_backwards"] == samples * n_train
        assert r["optimizer_steps"] == 1
    with open(os.path.join(args.output_dir, "reward.txt")) as f:
        assert [float(x) for x in f.read().split()] == pytest.approx([r["reward_mean"] for r in records])
    # Checkpoints are diffusers drop-ins written after the step's update.
    from diffusers import FluxTransformer2DModel
    c1, c2 = (os.path.join(args.output_dir, f"checkpoint-{s}-0") for s in (1, 2))
    model = FluxTransformer2DModel.from_pretrained(c2)
    w0 = load_file(os.path.join(args.pretrained_model_name_or_path, "transformer",
                                "diffusion_pytorch_model.safetensors"))
    w1, w2 = (load_file(os.path.join(c, "diffusion_pytorch_model.safetensors")) for c in (c1, c2))
    assert set(w2) == set(model.state_dict()) == set(w0)
    assert any(not torch.equal(w0[k], w1[k]) for k in w0)  # checkpoint-1 holds one update
    assert any(not torch.equal(w1[k], w2[k]) for k in w0)
    assert not any(name.endswith(".tmp") for name in os.listdir(args.output_dir))


def test_resume_continues_exactly(make_args, tmp_path):
    straight = make_args(*FAST, "--max_train_steps", 3, "--output_dir", tmp_path / "a")
    train_grpo_flux.main(straight)
    first = make_args(*FAST, "--max_train_steps", 2, "--output_dir", tmp_path / "b")
    train_grpo_flux.main(first)
    resumed = make_args(*FAST, "--max_train_steps", 3, "--output_dir", tmp_path / "b",
                        "--resume_from_checkpoint", "latest")
    train_grpo_flux.main(resumed)
    a, b = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert [r["step"] for r in b] == [1, 2, 3]
    assert b[2]["reward_mean"] == pytest.approx(a[2]["reward_mean"], abs=1e-6)
    wa = load_file(str(tmp_path / "a" / "checkpoint-3-0" / "diffusion_pytorch_model.safetensors"))
    wb = load_file(str(tmp_path / "b" / "checkpoint-3-0" / "diffusion_pytorch_model.safetensors"))
    assert all(torch.allclose(wa[k], wb[k], atol=1e-6) for k in wa)


def test_missing_model_folder_is_a_clear_error(make_args, tmp_path):
    args = make_args("--pretrained_model_name_or_path", tmp_path / "nowhere")
    with pytest.raises(MissingFileError, match="--preset tiny"):
        train_grpo_flux.main(args)


def test_empty_prompt_list_is_a_clear_error(make_args, tmp_path):
    empty = tmp_path / "prompts.json"
    empty.write_text("[]")
    with pytest.raises(ConfigError, match="holds no prompts"):
        train_grpo_flux.main(make_args("--data_json_path", empty))


@pytest.mark.parametrize("flags,message", [
    (["--reward", "nope"], "Unknown reward 'nope'"),
    (["--timestep_fraction", "0"], "timestep_fraction"),
    (["--timestep_fraction", "1.5"], "timestep_fraction"),
    (["--eta", "0"], "--eta must be > 0"),
    # tiny: 2 prompts x 4 generations per rank: a GA of 16 would train on a loss scaled by 8 / 16
    (["--train_batch_size", "2", "--num_generations", "4", "--gradient_accumulation_steps", "16"],
     "--gradient_accumulation_steps 16 exceeds the 8 samples a rank trains per step"),
])
def test_bad_flags_exit_with_message(make_args, capsys, flags, message):
    with pytest.raises(SystemExit) as exc:
        make_args(*flags)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


FLUX, QWEN = "dancegrpo.train_grpo_flux", "dancegrpo.train_grpo_qwenimage"


@pytest.mark.parametrize("module,flags,message", [
    (FLUX, ["--pretrained_model_name_or_path", "{tmp}/missing"], "lacks transformer/config.json"),
    (QWEN, ["--pretrained_model_name_or_path", "{tmp}/missing"], "lacks transformer/config.json"),
    (QWEN, ["--data_json_path", "{tmp}/none.json"], "does not exist"),
    (QWEN, ["--resume_from_checkpoint", "{tmp}/nowhere"], "holds no diffusion_pytorch_model.safetensors"),
], ids=["flux-weights", "qwen-weights", "qwen-data", "qwen-resume"])
def test_cli_exit_code_and_message_for_user_errors(tmp_path, cache_dir, capsys, module, flags, message):
    """Both entry points' `__main__` turn a user error into one message and exit 2 (no traceback;
    in this process: helpers.run_main)."""
    flags = [f.format(tmp=tmp_path) for f in flags]
    code = run_main(module, "--preset", "tiny", "--cache_dir", cache_dir, "--output_dir", tmp_path / "o", *flags)
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert message in err and "Traceback" not in err


def test_nan_reward_stops_before_the_update(make_args, monkeypatch):
    from dancegrpo.rewards import RewardNotFiniteError, builtin
    monkeypatch.setattr(builtin, "jpeg_kilobytes", lambda im, quality=95: float("nan"))
    args = make_args(*FAST, "--max_train_steps", 1)
    with pytest.raises(RewardNotFiniteError, match="NaN/inf"):
        train_grpo_flux.main(args)
    assert not os.path.exists(os.path.join(args.output_dir, "checkpoint-1-0"))


def test_ema_checkpoint_holds_the_moving_average(make_args):
    args = make_args(*FAST, "--max_train_steps", 1, "--use_ema", "--ema_decay", 0.25)
    train_grpo_flux.main(args)
    ckpt = os.path.join(args.output_dir, "checkpoint-1-0")
    w0 = load_file(os.path.join(args.pretrained_model_name_or_path, "transformer",
                                "diffusion_pytorch_model.safetensors"))
    w1 = load_file(os.path.join(ckpt, "diffusion_pytorch_model.safetensors"))
    ema = load_file(os.path.join(ckpt, "ema", "diffusion_pytorch_model.safetensors"))
    assert any(not torch.equal(w0[k], w1[k]) for k in w0)
    assert all(torch.allclose(ema[k], 0.25 * w0[k] + 0.75 * w1[k], atol=1e-6) for k in w0)


def test_resume_restores_the_ema(make_args, tmp_path):
    ema = ["--use_ema", "--ema_decay", 0.5]
    train_grpo_flux.main(make_args(*FAST, *ema, "--max_train_steps", 2, "--output_dir", tmp_path / "a"))
    train_grpo_flux.main(make_args(*FAST, *ema, "--max_train_steps", 1, "--output_dir", tmp_path / "b"))
    train_grpo_flux.main(make_args(*FAST, *ema, "--max_train_steps", 2, "--output_dir", tmp_path / "b",
                                   "--resume_from_checkpoint", tmp_path / "b" / "checkpoint-1-0"))
    ea, eb = (load_file(str(tmp_path / r / "checkpoint-2-0" / "ema" / "diffusion_pytorch_model.safetensors"))
              for r in "ab")
    assert all(torch.allclose(ea[k], eb[k], atol=1e-6) for k in ea)
