"""The reference policy of Flow-GRPO's KL term (--kl_beta): the base weights, run without grad.

With LoRA it is the trained model itself with its adapter switched off (Flow-GRPO's
`disable_adapter` for SD3 / FLUX); without LoRA, a frozen copy of the weights as loaded, taken
before any wrapping (Flow-GRPO's Qwen trainer; it costs one more copy of the weights per rank,
unsharded, and its passes are not in the transformer pass counts).
"""
import contextlib
import copy

import torch


def frozen_copy(raw):
    """A copy of the loaded transformer that no optimizer, wrapper or adapter reaches."""
    twin = copy.deepcopy(raw)
    twin.requires_grad_(False)
    return twin.eval()


@contextlib.contextmanager
def adapters_off(raw):
    raw.disable_adapters()
    try:
        yield
    finally:
        raw.enable_adapters()


class Reference:
    """reference(latents, timesteps, cond) -> the reference output, no graph.

    run(model, latents, timesteps, cond) is the trainer's own forward (autocast, family)."""

    def __init__(self, run, model, lora_raw=None):
        self.run, self.model, self.lora_raw = run, model, lora_raw

    def __call__(self, latents, timesteps, cond):
        off = adapters_off(self.lora_raw) if self.lora_raw is not None else contextlib.nullcontext()
        with torch.no_grad(), off:
            return self.run(self.model, latents, timesteps, cond)
