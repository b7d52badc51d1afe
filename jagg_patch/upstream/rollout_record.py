"""The model outputs of upstream's own rollout, recorded by a forward hook on the transformer while
its sample_reference_model runs (nothing of upstream is edited), laid out as [B, S, L, C].

Each recorded call is matched to the stored latents it was fed: calls come chunk by chunk, S per
chunk, and a call's input must equal all_latents[rows, step]. If upstream samples another way, the
layout is refused (None) and the middle members are forwarded instead, with one warning.
"""
import warnings

import torch

from dancegrpo.utils.metrics import first_tensor


class RolloutRecorder:
    """Context manager: records (input latents, output) of every transformer call inside it."""

    def __init__(self, module):
        self.module, self.calls, self._handle = module, [], None

    def __enter__(self):
        self._handle = self.module.register_forward_hook(self._on_forward, with_kwargs=True)
        return self

    def __exit__(self, *exc):
        self._handle.remove()
        return False

    def _on_forward(self, module, args, kwargs, output):
        latents = kwargs.get("hidden_states", args[0] if args else None)
        self.calls.append((latents, first_tensor(output).detach()))

    def outputs(self, all_latents):
        """[B, S, L, C] model outputs, row b / step k fed all_latents[b, k]; None (with a warning) when
        the calls do not lay out that way. Frees the recorded calls."""
        calls, self.calls = self.calls, []
        num_samples, steps = all_latents.shape[0], all_latents.shape[1] - 1
        chunks, row, c = [], 0, 0
        while c < len(calls) and row < num_samples:
            m = calls[c][0].shape[0]
            chunk = calls[c:c + steps]
            if len(chunk) < steps or not all(_fed(latents, all_latents[row:row + m, k])
                                             for k, (latents, _) in enumerate(chunk)):
                break
            chunks.append(torch.stack([out for _, out in chunk], dim=1))
            row, c = row + m, c + steps
        if row != num_samples or c != len(calls):
            warnings.warn(f"jagg_patch.upstream: the rollout's {len(calls)} transformer calls do not match its "
                          f"{num_samples} x {steps} stored latents, so its outputs are not reused this step (the "
                          "middle members are forwarded without grad instead)", stacklevel=2)
            return None
        return torch.cat(chunks)


def _fed(latents, stored):
    return (latents is not None and latents.shape == stored.shape
            and torch.equal(latents.to(stored.dtype), stored))
