"""What is trained, and what is added to the model: the full weights, or a LoRA adapter
(--use_lora), and the frozen reference of the KL term (kinds.py). The adapter code (torch, peft)
loads on first use; the command line reads only flags.py (dancegrpo.utils.lazy)."""
from ..utils.lazy import lazy_exports

__getattr__ = lazy_exports(__name__, {"build_adapter": ".kinds", "FullModel": ".kinds", "LoraAdapter": ".kinds"})

__all__ = ["build_adapter", "FullModel", "LoraAdapter"]
