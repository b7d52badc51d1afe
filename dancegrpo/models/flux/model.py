"""Flux (FLUX.1-dev): FluxTransformer2DModel + AutoencoderKL, as upstream trains it."""
import torch

from ..base import (ModelFamily, decode_context, model_config, latents_to_pil, pack_latents, prepare_latent_image_ids,
                   unpack_latents)


def text_ids(cond):
    """Text position ids [T, 3] for the transformer (unbatched: identical for every prompt).

    Upstream's preprocessing saves one [3] row per prompt and its trainer repeats it to [T, 3];
    files holding the full [T, 3] are read as they are."""
    ids = cond["text_ids"][0]
    if ids.ndim == 1:
        ids = ids.unsqueeze(0).expand(cond["encoder_hidden_states"].shape[1], -1)
    return ids


class FluxFamily(ModelFamily):
    name = "flux"
    embedding_fields = {
        "encoder_hidden_states": ("prompt_embed_path", "prompt_embed"),
        "pooled_prompt_embeds": ("pooled_prompt_embeds_path", "pooled_prompt_embeds"),
        "text_ids": ("text_ids", "text_ids"),
    }
    block_class_names = ("FluxTransformerBlock", "FluxSingleTransformerBlock")
    transformer_class_name = "FluxTransformer2DModel"
    vae_class_name = "AutoencoderKL"
    pipeline_class_name = "FluxPipeline"  # its save_lora_weights / load_lora_weights: the LoRA file format

    def embedding_layout(self, config):
        # T5 tokens x joint_attention_dim, CLIP pooled, and text_ids as upstream saves it ([3]) or repeated ([T, 3]).
        return {"encoder_hidden_states": ((None, config["joint_attention_dim"]),),
                "pooled_prompt_embeds": ((config["pooled_projection_dim"],),),
                "text_ids": ((3,), (None, 3))}

    def __init__(self, args):
        super().__init__(args)
        self.guidance = getattr(args, "guidance", 3.5)

    def initial_noise(self, n, generator, device):
        lh, lw = self.latent_hw
        noise = torch.randn((n, self.latent_channels, lh, lw), generator=generator, device=generator.device)
        return pack_latents(noise.to(device), n, self.latent_channels, lh, lw)

    def predict(self, transformer, latents, timesteps, cond):
        lh, lw = self.latent_hw
        img_ids = prepare_latent_image_ids(1, lh // 2, lw // 2, latents.device, latents.dtype)
        guidance = None
        if model_config(transformer).guidance_embeds:
            guidance = torch.full((latents.shape[0],), self.guidance, device=latents.device)
        return transformer(
            hidden_states=latents,
            encoder_hidden_states=cond["encoder_hidden_states"],
            pooled_projections=cond["pooled_prompt_embeds"],
            timestep=timesteps,
            img_ids=img_ids,
            txt_ids=text_ids(cond),
            guidance=guidance,
            return_dict=False,
        )[0]

    def decode(self, vae, latents):
        x = unpack_latents(latents, self.height, self.width, self.vae_scale_factor)
        x = x / vae.config.scaling_factor + vae.config.shift_factor
        with decode_context(x.device, self.mixed_precision):
            images = vae.decode(x.to(vae.dtype), return_dict=False)[0]
        return latents_to_pil(images)
