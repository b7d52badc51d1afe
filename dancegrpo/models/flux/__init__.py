"""Flux (FLUX.1-dev): the family class, its embedding layout, presets, digits build spec and
prompt-embedding writer (parts listed in dancegrpo.models.registry)."""
from .model import FluxFamily, text_ids

FAMILY = FluxFamily

__all__ = ["FAMILY", "FluxFamily", "text_ids"]
