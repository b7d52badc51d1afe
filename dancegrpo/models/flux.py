"""Flux (FLUX.1-dev): FluxTransformer2DModel + AutoencoderKL, as upstream trains it."""
import torch

from .base import ModelFamily, latents_to_pil, pack_latents, prepare_latent_image_ids, unpack_latents


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
        if transformer.config.guidance_embeds:
            guidance = torch.full((latents.shape[0],), self.guidance, device=latents.device)
        return transformer(
            hidden_states=latents,
            encoder_hidden_states=cond["encoder_hidden_states"],
            pooled_projections=cond["pooled_prompt_embeds"],
            timestep=timesteps,
            img_ids=img_ids,
            txt_ids=cond["text_ids"][0],  # identical for every prompt; Flux takes them unbatched
            guidance=guidance,
            return_dict=False,
        )[0]

    def decode(self, vae, latents):
        x = unpack_latents(latents, self.height, self.width, self.vae_scale_factor)
        x = x / vae.config.scaling_factor + vae.config.shift_factor
        with torch.inference_mode():
            images = vae.decode(x.to(vae.dtype), return_dict=False)[0]
        return latents_to_pil(images)
