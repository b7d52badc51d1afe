"""Interchangeable with upstream DanceGRPO: its embedding files, its checkpoints, its numerics
(selective checkpointing, FSDP precision, reward precision, VAE tiling). Each reference below is
written from upstream's recorded behaviour, not from the code under test."""
import json
import math
import os

import pytest
import torch
from safetensors.torch import save_file

from dancegrpo import train_grpo_flux
from dancegrpo.utils.fsdp_util import apply_activation_checkpointing, fsdp_mixed_precision, resolve_weight_type
from dancegrpo.errors import MissingFileError
from dancegrpo.models import base
from dancegrpo.models.flux import FluxFamily
from dancegrpo.run.resume import plan_run
from dancegrpo.trainer import setup

from helpers import FAST


# ------------------------------------------------------------------ selective checkpointing
class Block(torch.nn.Linear):
    pass


def _stack(n):
    return torch.nn.Sequential(torch.nn.Linear(2, 2), *[Block(2, 2) for _ in range(n)], torch.nn.Linear(2, 2))


def _upstream_picks(n, p):
    """Upstream's rule restated: with a running cut-off c (from 1/2), block i = 1..n is picked when
    i * p >= c. Equivalently round-half-up(i * p) steps up at block i."""
    return [i - 1 for i in range(1, n + 1) if math.floor(i * p + 0.5) > math.floor((i - 1) * p + 0.5)]


@pytest.mark.parametrize("p", [0.0, 0.25, 1 / 3, 0.5, 0.75, 1.0])
def test_selective_checkpointing_spreads_blocks_as_upstream(p):
    model = _stack(12)
    apply_activation_checkpointing(model, (Block,), p)
    blocks = [m for m in model if type(m).__name__ != "Linear"]
    wrapped = [i for i, m in enumerate(blocks) if type(m).__name__ == "CheckpointWrapper"]
    assert wrapped == _upstream_picks(12, p)
    if p == 0.5:
        assert wrapped == [0, 2, 4, 6, 8, 10]  # every second block, not the first half


# ------------------------------------------------------------------ Flux embedding files
def _upstream_flux_folder(root, n, tokens, dim, pooled_dim):
    """A folder as upstream's preprocess_flux_rl_embeddings writes it: text_ids one [3] row."""
    for sub in ("prompt_embed", "pooled_prompt_embeds", "text_ids"):
        os.makedirs(os.path.join(root, sub))
    items, g = [], torch.Generator().manual_seed(0)
    for i in range(n):
        name = f"{i}.pt"
        torch.save(torch.randn(tokens, dim, generator=g), os.path.join(root, "prompt_embed", name))
        torch.save(torch.randn(pooled_dim, generator=g), os.path.join(root, "pooled_prompt_embeds", name))
        torch.save(torch.zeros(3), os.path.join(root, "text_ids", name))
        items.append({"prompt_embed_path": name, "text_ids": name, "pooled_prompt_embeds_path": name,
                      "caption": f"prompt number {i}"})
    path = os.path.join(root, "videos2caption.json")
    with open(path, "w") as f:
        json.dump(items, f)
    return path


def test_an_upstream_flux_embedding_folder_trains(make_args, tmp_path):
    data = _upstream_flux_folder(str(tmp_path / "emb"), 4, tokens=8, dim=32, pooled_dim=32)
    history = train_grpo_flux.main(make_args("--data_json_path", data, "--max_train_steps", 1, "--train_batch_size", 2,
                                             "--num_generations", 2, "--gradient_accumulation_steps", 4))
    assert len(history) == 1 and history[0]["samples"] == 4 and math.isfinite(history[0]["loss"])


def test_text_ids_row_and_full_layouts_predict_the_same(make_args):
    args = make_args()
    family = FluxFamily(args)
    transformer, _ = family.load(args, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(2, 16, 64, generator=g)
    cond = {"encoder_hidden_states": torch.randn(2, 8, 32, generator=g),
            "pooled_prompt_embeds": torch.randn(2, 32, generator=g)}
    row = torch.tensor([[0.0, 3.0, 5.0]]).repeat(2, 1)               # upstream: [B, 3]
    t = torch.full((2,), 0.7)
    with torch.no_grad():
        v_row = family.predict(transformer, latents, t, {**cond, "text_ids": row})
        v_full = family.predict(transformer, latents, t, {**cond, "text_ids": row[:, None].expand(2, 8, 3)})
        v_other = family.predict(transformer, latents, t, {**cond, "text_ids": torch.zeros(2, 3)})
    assert torch.equal(v_row, v_full)
    assert (v_row - v_other).abs().max() > 1e-6  # the ids reach the model: the comparison can fail


# ------------------------------------------------------------------ upstream checkpoints
def _upstream_checkpoint(args, folder, scale):
    """An upstream checkpoint-[ema-]STEP-EPOCH folder: the full state dict as safetensors plus config.json."""
    family = FluxFamily(args)
    transformer, _ = family.load(args, torch.device("cpu"))
    state = {k: v * scale for k, v in transformer.state_dict().items()}
    os.makedirs(folder)
    save_file(state, os.path.join(folder, "diffusion_pytorch_model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(dict(transformer.config), f, default=list)
    return state


def test_resume_from_an_upstream_ema_checkpoint_starts_from_its_weights(make_args, tmp_path):
    upstream = tmp_path / "upstream_run"
    folder = str(upstream / "checkpoint-ema-40-0")
    saved = _upstream_checkpoint(make_args(), folder, 1.5)
    args = make_args(*FAST, "--max_train_steps", 1, "--output_dir", tmp_path / "mine", "--resume_from_checkpoint",
                     folder)
    printed = []
    lock, plan = plan_run(args, "t", log=printed.append)
    lock.release()
    assert plan["resume"] == folder and not plan["full_resume"]
    assert any("weights only" in m and "FRESH optimizer state" in m and "step 0" in m for m in printed), printed
    ctx = setup(args, FluxFamily(args), plan)
    loaded = ctx.raw_transformer.state_dict()
    assert ctx.step == 0 and not ctx.optimizer.state
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)
    history = train_grpo_flux.main(args)
    assert [r["step"] for r in history] == [1]
    assert os.path.isfile(tmp_path / "mine" / "checkpoint-1-0" / "diffusion_pytorch_model.safetensors")
    # 'latest' in upstream's folder finds no resumable checkpoint and says how to use its weights.
    with pytest.raises(MissingFileError, match="checkpoint-ema-40-0 with a new --output_dir"):
        from dancegrpo.utils.checkpoint import resolve_resume_path
        resolve_resume_path("latest", str(upstream), log=lambda m: None)


# ------------------------------------------------------------------ FSDP precision
def test_master_weight_type_defaults_and_mixed_precision():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_weight_type(None, "bf16", cuda) == "bf16"      # Qwen-Image on GPU, as upstream
    assert resolve_weight_type(None, "fp32", cuda) == "fp32"      # Flux on GPU: fp32 + autocast
    assert resolve_weight_type(None, "bf16", cpu) == "fp32"
    assert resolve_weight_type("fp32", "bf16", cuda) == "fp32"    # the flag wins
    mp = fsdp_mixed_precision("bf16")
    assert (mp.param_dtype, mp.reduce_dtype, mp.buffer_dtype) == (torch.bfloat16,) * 3
    mp = fsdp_mixed_precision("fp32")
    assert (mp.param_dtype, mp.reduce_dtype, mp.buffer_dtype) == (torch.float32,) * 3
    from dancegrpo.models.qwenimage import QwenImageFamily
    assert (QwenImageFamily.gpu_fsdp_weight_type, FluxFamily.gpu_fsdp_weight_type) == ("bf16", "fp32")


def test_master_weight_type_flag(make_args, capsys):
    assert make_args("--master_weight_type", "bf16").master_weight_type == "bf16"
    with pytest.raises(SystemExit):
        make_args("--master_weight_type", "fp16")
    assert "--master_weight_type" in capsys.readouterr().err


# ------------------------------------------------------------------ rewards and VAE precision
def test_reward_precision_is_upstreams(tiny_hps, tiny_hf_clip, monkeypatch):
    """HPSv2 scores under fp16 autocast on GPU, PickScore in fp32 (no autocast)."""
    from dancegrpo.rewards import hf_clip, hpsv2, pickscore
    from tiny_models import options, random_images
    asked = []

    def record(device, dtype):
        asked.append(dtype)
        import contextlib
        return contextlib.nullcontext()
    monkeypatch.setattr(hpsv2, "reward_autocast", record)
    monkeypatch.setattr(hf_clip, "reward_autocast", record)
    images = random_images([(32, 32)])
    hpsv2.build("cpu", options(hps_ckpt_dir=tiny_hps[0], hps_arch=tiny_hps[1]))(images, ["a cat"])
    pickscore.build("cpu", options(pickscore_processor_path=tiny_hf_clip[0],
                                   pickscore_model_path=tiny_hf_clip[1]))(images, ["a cat"])
    assert asked == [torch.float16, None]


def test_vae_tiles_on_gpu_at_upstream_sizes(make_args, monkeypatch):
    assert base.wants_tiled_decode(torch.device("cuda"), 720, 720)
    assert base.wants_tiled_decode(torch.device("cuda"), 512, 256)
    assert not base.wants_tiled_decode(torch.device("cuda"), 256, 256)
    assert not base.wants_tiled_decode(torch.device("cpu"), 720, 720)
    args = make_args()
    _, vae = FluxFamily(args).load(args, torch.device("cpu"))
    assert not vae.use_tiling
    monkeypatch.setattr(base, "wants_tiled_decode", lambda device, h, w: True)
    _, vae = FluxFamily(args).load(args, torch.device("cpu"))
    assert vae.use_tiling
