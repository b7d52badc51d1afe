"""Flux's embedded presets (dancegrpo.presets builds and loads them)."""
import os

from ..preset_defaults import (DIGITS_DEFAULTS, DIGITS_DIR, DIGITS_LARGE_DEFAULTS, DIGITS_LARGE_DIR,
                              SMALL_DEFAULTS, TINY_DEFAULTS)

VAE = dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
           up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 16, 32, 32),
           layers_per_block=1, latent_channels=16, norm_num_groups=8, scaling_factor=0.3611,
           shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)

PRESETS = {
    "tiny": dict(
        transformer=("FluxTransformer2DModel", dict(
            patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
            axes_dims_rope=(4, 4, 8))),
        vae=("AutoencoderKL", VAE),
        text=dict(tokens=8, dim=32, pooled_dim=32),
        num_prompts=8, defaults=TINY_DEFAULTS),
    "small": dict(
        transformer=("FluxTransformer2DModel", dict(
            patch_size=1, in_channels=64, num_layers=2, num_single_layers=4, attention_head_dim=64,
            num_attention_heads=6, joint_attention_dim=128, pooled_projection_dim=64, guidance_embeds=True,
            axes_dims_rope=(16, 24, 24))),
        vae=("AutoencoderKL", VAE),
        text=dict(tokens=32, dim=128, pooled_dim=64),
        num_prompts=16, defaults=SMALL_DEFAULTS),
    "digits": dict(shipped=os.path.join(DIGITS_DIR, "flux"), num_prompts=40, defaults=DIGITS_DEFAULTS),
    "digits_large": dict(shipped=os.path.join(DIGITS_LARGE_DIR, "flux"), num_prompts=40,
                         defaults=DIGITS_LARGE_DEFAULTS),
}
