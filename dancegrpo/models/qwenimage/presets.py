"""Qwen-Image's embedded presets (dancegrpo.presets builds and loads them)."""
import os

from ..preset_defaults import (DIGITS_DEFAULTS, DIGITS_DIR, DIGITS_LARGE_DEFAULTS, DIGITS_LARGE_DIR,
                              SMALL_DEFAULTS, TINY_DEFAULTS)

VAE = dict(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1, attn_scales=[],
           temperal_downsample=[False, True, True])

# 8 prompts x 12 samples (upstream's group size) instead of 16: at S 20 the 6-block model's 60-step
# run takes 5.6 min with 16 (5.56 s a step on one thread), over the world's 5-minute budget.
QWEN_LARGE_BATCH = dict(num_generations=12, gradient_accumulation_steps=96, sample_batch_size=96)

PRESETS = {
    "tiny": dict(
        transformer=("QwenImageTransformer2DModel", dict(
            patch_size=2, in_channels=64, out_channels=16, num_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 4, 8))),
        vae=("AutoencoderKLQwenImage", VAE),
        text=dict(tokens=16, min_tokens=8, dim=32),
        num_prompts=8, defaults=TINY_DEFAULTS),
    "small": dict(
        transformer=("QwenImageTransformer2DModel", dict(
            patch_size=2, in_channels=64, out_channels=16, num_layers=4, attention_head_dim=64,
            num_attention_heads=6, joint_attention_dim=128, axes_dims_rope=(16, 24, 24))),
        vae=("AutoencoderKLQwenImage", VAE),
        text=dict(tokens=48, min_tokens=16, dim=128),
        num_prompts=16, defaults=SMALL_DEFAULTS),
    "digits": dict(shipped=os.path.join(DIGITS_DIR, "qwenimage"), num_prompts=40, defaults=DIGITS_DEFAULTS),
    "digits_large": dict(shipped=os.path.join(DIGITS_LARGE_DIR, "qwenimage"), num_prompts=40,
                         defaults=dict(DIGITS_LARGE_DEFAULTS, sampling_steps=20, **QWEN_LARGE_BATCH)),
}
