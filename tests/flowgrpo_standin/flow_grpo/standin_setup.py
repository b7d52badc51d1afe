# Not upstream's: what stands, in this stand-in checkout, for Flow-GRPO's model folder, its three text
# encoders and the user's Ctrl-C.
# - tiny_sd3_pipeline: what StableDiffusion3Pipeline.from_pretrained gives upstream, tiny, built on the
#   fly (a SD3Transformer2DModel, a VAE, the flow-matching scheduler with SD3's shift 3), no text encoders;
# - compute_text_embeddings: the frozen encoders' output, fixed embeddings drawn from each prompt's text;
# - stop_here: upstream's epoch loop is `while True` and ends when the user stops it; the stand-in stops
#   at the top of epoch FLOWGRPO_STANDIN_EPOCHS (after that epoch's evaluation and checkpoint), as Ctrl-C would there.
import os
import sys

import torch

SIZES = {   # config.pretrained.model -> the transformer's size
    "tiny": dict(num_layers=2, attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                 caption_projection_dim=16, pooled_projection_dim=8),
    "small": dict(num_layers=4, attention_head_dim=32, num_attention_heads=4, joint_attention_dim=64,
                  caption_projection_dim=128, pooled_projection_dim=32),
}
TEXT_TOKENS = 4


def tiny_sd3_pipeline(model="tiny", dtype=torch.float64, seed=0, sample_size=32):
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    default = torch.get_default_dtype()
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        torch.set_default_dtype(dtype)
        try:
            transformer = SD3Transformer2DModel(sample_size=sample_size, patch_size=2, in_channels=4, out_channels=4,
                                                pos_embed_max_size=sample_size, **SIZES[model])
            vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                                up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(4, 8),
                                layers_per_block=1, latent_channels=4, norm_num_groups=4,
                                scaling_factor=1.5305, shift_factor=0.0609)
        finally:
            torch.set_default_dtype(default)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    return StableDiffusion3Pipeline(transformer=transformer, scheduler=scheduler, vae=vae, text_encoder=None,
                                    tokenizer=None, text_encoder_2=None, tokenizer_2=None, text_encoder_3=None,
                                    tokenizer_3=None)


def compute_text_embeddings(prompts, pipeline, dtype):
    """(prompt_embeds [B, tokens, joint_attention_dim], pooled_prompt_embeds [B, pooled_projection_dim])."""
    config = pipeline.transformer.config
    embeds, pooled = [], []
    for prompt in prompts:
        g = torch.Generator().manual_seed(sum(map(ord, prompt)) + 11)
        embeds.append(torch.randn(TEXT_TOKENS, config.joint_attention_dim, generator=g, dtype=torch.float64))
        pooled.append(torch.randn(config.pooled_projection_dim, generator=g, dtype=torch.float64))
    return torch.stack(embeds).to(dtype), torch.stack(pooled).to(dtype)


def stop_here(epoch, accelerator):
    stop = os.environ.get("FLOWGRPO_STANDIN_EPOCHS")
    if stop is not None and epoch >= int(stop):
        accelerator.wait_for_everyone()
        sys.exit(0)
