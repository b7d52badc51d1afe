"""Model families. A family is the only model-specific code of the trainer:
load, build the model inputs, predict the velocity, decode latents to images."""
from .base import ModelFamily, pack_latents, unpack_latents, prepare_latent_image_ids, latents_to_pil

__all__ = ["ModelFamily", "pack_latents", "unpack_latents", "prepare_latent_image_ids", "latents_to_pil"]
