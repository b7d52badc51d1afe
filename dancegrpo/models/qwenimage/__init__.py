"""Qwen-Image: the family class, its embedding layout, presets, digits build spec and
prompt-embedding writer (parts listed in dancegrpo.models.registry)."""
from .model import QwenImageFamily

FAMILY = QwenImageFamily

__all__ = ["FAMILY", "QwenImageFamily"]
