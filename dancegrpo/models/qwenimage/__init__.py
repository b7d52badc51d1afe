"""Qwen-Image: the family class, its embedding layout, presets, digits build spec and
prompt-embedding writer (parts listed in dancegrpo.models.registry). The model code loads on first
use (dancegrpo.utils.lazy): the presets part alone builds the command line."""
from ...utils.lazy import lazy_exports

__getattr__ = lazy_exports(__name__, {"FAMILY": (".model", "QwenImageFamily"), "QwenImageFamily": ".model"})

__all__ = ["FAMILY", "QwenImageFamily"]
