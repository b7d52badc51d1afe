"""Model families. A family is the only model-specific code of the trainer: load, build the model
inputs, predict the velocity, decode latents to images; each lives in its own package
(dancegrpo/models/<family>/), found through one registry (dancegrpo.models.registry). The shared
model code (base) loads on first use (dancegrpo.utils.lazy)."""
from ..utils.lazy import lazy_exports
from .registry import family_class, family_names, family_part, register_family

__getattr__ = lazy_exports(__name__, {name: ".base" for name in (
    "ModelFamily", "pack_latents", "unpack_latents", "prepare_latent_image_ids", "latents_to_pil")})

__all__ = ["ModelFamily", "pack_latents", "unpack_latents", "prepare_latent_image_ids", "latents_to_pil",
           "family_class", "family_names", "family_part", "register_family"]
