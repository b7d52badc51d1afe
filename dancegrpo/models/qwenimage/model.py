"""Qwen-Image: QwenImageTransformer2DModel + AutoencoderKLQwenImage, as upstream trains it.

Differences from Flux, as upstream's Qwen-Image trainer has them:
- the text condition is a zero-padded [B, T, D] embedding plus its attention
  mask [B, T] (1 = real token); the model gets `encoder_hidden_states_mask`,
  `img_shapes` [(1, h/16, w/16)] per sample and (diffusers < 0.36) `txt_seq_lens`
  derived from the mask; no guidance, no pooled embeds, no txt/img ids;
- latents are 5-D [B, 16, 1, h/8, w/8] (one frame), packed into 2x2 tokens like Flux;
- the VAE un-normalises with `latents_mean` / `latents_std` from its config and
  decodes a one-frame video: frame 0 is the image.
"""
import inspect

import torch

from ..base import ModelFamily, decode_context, model_config, latents_to_pil, pack_latents, unpack_latents


class QwenImageFamily(ModelFamily):
    name = "qwenimage"
    # Upstream's layout (preprocess_qwenimage_embedding): prompt_embed/ and prompt_attention_mask/,
    # plus "original_length" in the JSON (the mask carries the same information).
    embedding_fields = {
        "encoder_hidden_states": ("prompt_embed_path", "prompt_embed"),
        "encoder_hidden_states_mask": ("prompt_attention_mask", "prompt_attention_mask"),
    }
    block_class_names = ("QwenImageTransformerBlock",)
    gpu_fsdp_weight_type = "bf16"
    transformer_class_name = "QwenImageTransformer2DModel"
    vae_class_name = "AutoencoderKLQwenImage"
    pipeline_class_name = "QwenImagePipeline"  # its save_lora_weights / load_lora_weights: the LoRA file format

    def embedding_layout(self, config):
        # Qwen2.5-VL tokens (padded) x joint_attention_dim, and their mask.
        return {"encoder_hidden_states": ((None, config["joint_attention_dim"]),),
                "encoder_hidden_states_mask": ((None,),)}

    def __init__(self, args):
        super().__init__(args)
        self.guidance = getattr(args, "guidance", 3.5)
        self._takes_txt_seq_lens = None

    def initial_noise(self, n, generator, device):
        lh, lw = self.latent_hw
        # Drawn 5-D like upstream ([n, 1, 16, h/8, w/8]); the frame axis has size 1, so packing
        # the [n, 16, h/8, w/8] view gives upstream's tokens.
        noise = torch.randn((n, 1, self.latent_channels, lh, lw), generator=generator, device=generator.device)
        return pack_latents(noise.to(device).reshape(n, self.latent_channels, lh, lw), n, self.latent_channels, lh, lw)

    def text_inputs(self, cond):
        """Padded embeddings and mask, trimmed to the longest real prompt of the batch.

        Padding is masked out of attention and text RoPE positions do not depend on the
        padded length, so the trim changes nothing but the cost (upstream pads to 1024).
        """
        embeds, mask = cond["encoder_hidden_states"], cond["encoder_hidden_states_mask"]
        lengths = mask.sum(dim=1)
        keep = max(int(lengths.max()), 1)
        return embeds[:, :keep], mask[:, :keep], lengths

    def predict(self, transformer, latents, timesteps, cond):
        lh, lw = self.latent_hw
        embeds, mask, lengths = self.text_inputs(cond)
        kwargs = {}
        if self._takes_txt_seq_lens is None:
            self._takes_txt_seq_lens = "txt_seq_lens" in inspect.signature(transformer.forward).parameters
        if self._takes_txt_seq_lens:  # diffusers < 0.36 wants the true lengths explicitly
            kwargs["txt_seq_lens"] = [int(n) for n in lengths.tolist()]
        guidance = None
        if getattr(model_config(transformer), "guidance_embeds", False):
            guidance = torch.full((latents.shape[0],), self.guidance, device=latents.device)
        return transformer(
            hidden_states=latents,
            encoder_hidden_states=embeds.to(latents.dtype),  # preprocessing may have saved bf16
            encoder_hidden_states_mask=mask,
            timestep=timesteps,
            img_shapes=[[(1, lh // 2, lw // 2)]] * latents.shape[0],
            guidance=guidance,
            return_dict=False,
            **kwargs,
        )[0]

    def decode(self, vae, latents):
        x = unpack_latents(latents, self.height, self.width, self.vae_scale_factor).unsqueeze(2)  # [B, C, 1, h, w]
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(x.device, torch.float32)
        std = torch.tensor(vae.config.latents_std).view(shape).to(x.device, torch.float32)
        x = x.float() * std + mean
        with decode_context(x.device, self.mixed_precision):
            frames = vae.decode(x.to(vae.dtype), return_dict=False)[0]
        return latents_to_pil(frames[:, :, 0])
