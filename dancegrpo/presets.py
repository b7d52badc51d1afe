"""Embedded presets: small models and prompt embeddings built offline, seeded.

A preset writes a real diffusers model folder (transformer/, vae/) and an
embedding folder in upstream's layout, then the trainer loads both through the
SAME `from_pretrained` / dataset code a GPU user runs with real weights. A
preset only sets defaults: flags given on the command line win.
"""
import json
import os
import shutil
import uuid

import torch

from .errors import MissingFileError
from .utils.communications import launch_world_size

PROMPTS_FILE = os.path.join(os.path.dirname(__file__), "assets", "prompts.txt")
PRESET_VERSION = 1  # bump when a preset's models or data change, so stale caches are rebuilt


def bundled_prompts(n):
    with open(PROMPTS_FILE) as f:
        prompts = [line.strip() for line in f if line.strip()]
    return prompts[:n]


def _randn(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def save_flux_embeddings(root, entries):
    """[(caption, prompt_embed [T, D], pooled [P])] -> upstream's Flux layout under root (text_ids as
    one [3] row, as upstream saves it); returns the JSON items."""
    items = []
    for sub in ("prompt_embed", "pooled_prompt_embeds", "text_ids"):
        os.makedirs(os.path.join(root, sub), exist_ok=True)
    for i, (caption, embed, pooled) in enumerate(entries):
        name = f"{i:05d}.pt"
        torch.save(embed, os.path.join(root, "prompt_embed", name))
        torch.save(pooled, os.path.join(root, "pooled_prompt_embeds", name))
        torch.save(torch.zeros(3), os.path.join(root, "text_ids", name))
        items.append({"caption": caption, "prompt_embed_path": name, "pooled_prompt_embeds_path": name,
                      "text_ids": name})
    return items


def write_flux_embeddings(root, prompts, text):
    """Fixed random T5-like / CLIP-pooled embeddings, one file per prompt (upstream layout)."""
    return save_flux_embeddings(root, [(p, _randn((text["tokens"], text["dim"]), 1000 + i),
                                        _randn((text["pooled_dim"],), 2000 + i)) for i, p in enumerate(prompts)])


def save_qwenimage_embeddings(root, entries):
    """[(caption, zero-padded embeds [T, D], mask [T], 1 = real token)] -> upstream's Qwen-Image
    layout under root (true length also as "original_length" in the JSON); returns the JSON items."""
    items = []
    for sub in ("prompt_embed", "prompt_attention_mask"):
        os.makedirs(os.path.join(root, sub), exist_ok=True)
    for i, (caption, embeds, mask) in enumerate(entries):
        name = f"{i:05d}.pt"
        torch.save(embeds, os.path.join(root, "prompt_embed", name))
        torch.save(mask, os.path.join(root, "prompt_attention_mask", name))
        items.append({"caption": caption, "prompt_embed_path": name, "prompt_attention_mask": name,
                      "original_length": int(mask.sum())})
    return items


def write_qwenimage_embeddings(root, prompts, text):
    """Fixed random Qwen-like embeddings zero-padded to text["tokens"]; true lengths vary between
    text["min_tokens"] and text["tokens"] so padding is exercised."""
    span = text["tokens"] - text["min_tokens"] + 1
    entries = []
    for i, prompt in enumerate(prompts):
        length = text["min_tokens"] + (i * 5) % span
        embeds = torch.zeros(text["tokens"], text["dim"])
        embeds[:length] = _randn((length, text["dim"]), 3000 + i)
        mask = torch.zeros(text["tokens"], dtype=torch.long)
        mask[:length] = 1
        entries.append((prompt, embeds, mask))
    return save_qwenimage_embeddings(root, entries)


_FLUX_VAE = dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                 up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 16, 32, 32),
                 layers_per_block=1, latent_channels=16, norm_num_groups=8, scaling_factor=0.3611,
                 shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)

# Defaults shared by the tiny presets: the recipe measured to learn on 2 CPU cores
# on these CPUs: 8 prompts x 16 generations, ONE optimizer step per training step.
_QWEN_VAE = dict(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1, attn_scales=[],
                 temperal_downsample=[False, True, True])

_TINY_DEFAULTS = dict(h=64, w=64, sampling_steps=8, shift=3.0, eta=0.3, train_batch_size=8,
                      num_generations=16, use_group=True, init_same_noise=True, timestep_fraction=0.6,
                      learning_rate=1e-2, weight_decay=1e-4, max_grad_norm=1.0, gradient_accumulation_steps=128,
                      lr_warmup_steps=0, lr_scheduler="constant", max_train_steps=30, checkpointing_steps=1000,
                      reward="jpeg", seed=42, clip_range=1e-4, adv_clip_max=5.0, sample_batch_size=128,
                      update_batch_size=32, dataloader_num_workers=0)
# CPU benchmark geometry: ~20M parameters, 256 image tokens, upstream's S and fraction.
_SMALL_DEFAULTS = dict(h=256, w=256, sampling_steps=16, shift=3.0, eta=0.3, train_batch_size=1,
                       num_generations=4, use_group=True, init_same_noise=True, timestep_fraction=0.6,
                       learning_rate=1e-5, weight_decay=1e-4, max_grad_norm=1.0, gradient_accumulation_steps=4,
                       lr_warmup_steps=0, lr_scheduler="constant", max_train_steps=3, checkpointing_steps=1000,
                       reward="jpeg", seed=42, clip_range=1e-4, adv_clip_max=5.0, sample_batch_size=4,
                       update_batch_size=1, dataloader_num_workers=0)

# The digits world (dancegrpo.digits): models trained by `python -m dancegrpo.digits.build`, shipped
# in dancegrpo/assets/digits/<family>/ with their prompt data; nothing is built at run time.
# lr 1e-4 measured on Flux: 40 steps take the held-out correct-class rate from 61% to 83% (1e-3 wrecks
# the trained model: 43%; 2e-5 is slow: 65%; the shuffled control ends at 55%). The same defaults
# serve Qwen-Image: 60 steps, 70.5% -> 92.5% (seed 42, 200 evaluation samples).
_DIGITS_DEFAULTS = dict(_TINY_DEFAULTS, learning_rate=1e-4, max_train_steps=60, reward="digit", sample_every=20)
DIGITS_DIR = os.path.join(os.path.dirname(__file__), "assets", "digits")

PRESETS = {
    ("flux", "tiny"): dict(
        transformer=("FluxTransformer2DModel", dict(
            patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
            axes_dims_rope=(4, 4, 8))),
        vae=("AutoencoderKL", _FLUX_VAE),
        text=dict(tokens=8, dim=32, pooled_dim=32),
        num_prompts=8, write_embeddings=write_flux_embeddings, defaults=_TINY_DEFAULTS),
    ("flux", "small"): dict(
        transformer=("FluxTransformer2DModel", dict(
            patch_size=1, in_channels=64, num_layers=2, num_single_layers=4, attention_head_dim=64,
            num_attention_heads=6, joint_attention_dim=128, pooled_projection_dim=64, guidance_embeds=True,
            axes_dims_rope=(16, 24, 24))),
        vae=("AutoencoderKL", _FLUX_VAE),
        text=dict(tokens=32, dim=128, pooled_dim=64),
        num_prompts=16, write_embeddings=write_flux_embeddings, defaults=_SMALL_DEFAULTS),
    ("flux", "digits"): dict(shipped=os.path.join(DIGITS_DIR, "flux"), num_prompts=40, defaults=_DIGITS_DEFAULTS),
    ("qwenimage", "digits"): dict(shipped=os.path.join(DIGITS_DIR, "qwenimage"), num_prompts=40,
                                  defaults=_DIGITS_DEFAULTS),
    ("qwenimage", "tiny"): dict(
        transformer=("QwenImageTransformer2DModel", dict(
            patch_size=2, in_channels=64, out_channels=16, num_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 4, 8))),
        vae=("AutoencoderKLQwenImage", _QWEN_VAE),
        text=dict(tokens=16, min_tokens=8, dim=32),
        num_prompts=8, write_embeddings=write_qwenimage_embeddings, defaults=_TINY_DEFAULTS),
    ("qwenimage", "small"): dict(
        transformer=("QwenImageTransformer2DModel", dict(
            patch_size=2, in_channels=64, out_channels=16, num_layers=4, attention_head_dim=64,
            num_attention_heads=6, joint_attention_dim=128, axes_dims_rope=(16, 24, 24))),
        vae=("AutoencoderKLQwenImage", _QWEN_VAE),
        text=dict(tokens=48, min_tokens=16, dim=128),
        num_prompts=16, write_embeddings=write_qwenimage_embeddings, defaults=_SMALL_DEFAULTS),
}


def preset_names(family):
    return sorted(name for fam, name in PRESETS if fam == family)


def preset_spec(family, name):
    try:
        return PRESETS[(family, name)]
    except KeyError:
        raise ValueError(f"Unknown preset {name!r} for {family}; available: {preset_names(family)}") from None


def preset_root(cache_dir, family, name):
    return os.path.join(cache_dir, "presets", f"{family}-{name}-v{PRESET_VERSION}")


def materialize_preset(family, name, cache_dir, seed=0):
    """Build the preset's model folder and prompt data once; return its root.

    Built in a private temp folder and renamed into place, so concurrent ranks or
    an interrupted build never leave a half-written preset behind.
    """
    import diffusers
    spec = preset_spec(family, name)
    if "shipped" in spec:  # trained models that come with the package
        if not os.path.isfile(os.path.join(spec["shipped"], "transformer", "config.json")):
            raise MissingFileError(f"the {name} preset's models are missing from {spec['shipped']!r}; rebuild them "
                                   f"with `python -m dancegrpo.digits.build --family {family} --out {spec['shipped']}`")
        return spec["shipped"]
    root = preset_root(cache_dir, family, name)
    if os.path.isfile(os.path.join(root, "COMPLETE")):
        return root
    tmp = f"{root}.tmp-{uuid.uuid4().hex[:8]}"
    os.makedirs(tmp)
    try:
        for i, part in enumerate(("transformer", "vae")):
            cls_name, config = spec[part]
            torch.manual_seed(seed + i)
            getattr(diffusers, cls_name)(**config).save_pretrained(os.path.join(tmp, part))
        data_dir = os.path.join(tmp, "data")
        items = spec["write_embeddings"](data_dir, bundled_prompts(spec["num_prompts"]), spec["text"])
        with open(os.path.join(data_dir, "prompts.json"), "w") as f:
            json.dump(items, f, indent=1)
        open(os.path.join(tmp, "COMPLETE"), "w").close()
        try:
            os.rename(tmp, root)
        except OSError:  # another process finished first
            if not os.path.isfile(os.path.join(root, "COMPLETE")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root


def spec_defaults_for_world(defaults, num_prompts, world_size):
    """Under torchrun, split the preset's per-step prompts and GA over the ranks when one rank
    cannot hold them all: the ranks then train on the same global batch, and FSDP's mean over
    ranks of (per-rank sum / GA) equals the single-process gradient."""
    defaults = dict(defaults)
    if world_size > 1 and defaults["train_batch_size"] * world_size > num_prompts:
        defaults["train_batch_size"] = max(1, num_prompts // world_size)
        defaults["gradient_accumulation_steps"] = max(1, defaults["gradient_accumulation_steps"] // world_size)
    return defaults


def preset_defaults(family, name, cache_dir):
    """Materialize the preset and return the flag defaults it sets."""
    root = materialize_preset(family, name, cache_dir)
    spec = preset_spec(family, name)
    defaults = spec_defaults_for_world(spec["defaults"], spec["num_prompts"], launch_world_size())
    defaults.update(pretrained_model_name_or_path=root,
                    data_json_path=os.path.join(root, "data", "prompts.json"))
    return defaults
