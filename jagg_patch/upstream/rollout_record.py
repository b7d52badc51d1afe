"""The model outputs of upstream's own rollout, recorded by a forward hook on the transformer while
its sample_reference_model runs (nothing of upstream is edited), laid out as [B, S, rows, ...]:
sample b's raw output at step k, as a training call on that one sample returns it.

Each recorded call is matched to the stored latents it was fed: calls come chunk by chunk, S per
chunk; a call on m samples holds `rows` blocks of m rows (2 for a classifier-free-guided call: the
conditional rows, then the unconditional ones), and each block's input must hold
all_latents[chunk, step] (followed, along any axis, by what the trainer appends, e.g. a condition
image's tokens). If upstream samples another way, the layout is refused (None) and the middle
members are forwarded instead, with one warning.
"""
import warnings

import torch

from dancegrpo.utils.metrics import first_tensor


def per_sample(output, n):
    """The n samples' parts of one call's output of `rows` blocks of n rows: sample j's rows
    (j, n + j, ...) as one tensor [rows, ...]."""
    return list(output.reshape(output.shape[0] // n, n, *output.shape[1:]).unbind(1))


class RolloutRecorder:
    """Context manager: records (input latents, output) of every transformer call inside it."""

    def __init__(self, module, rows=1):
        self.module, self.rows, self.calls, self._handle = module, rows, [], None

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
        """[B, S, rows, ...] model outputs, sample b / step k fed all_latents[b, k]; None (with a
        warning) when the calls do not lay out that way. Frees the recorded calls."""
        calls, self.calls = self.calls, []
        num_samples, steps = all_latents.shape[0], all_latents.shape[1] - 1
        chunks, row, c = [], 0, 0
        while c < len(calls) and row < num_samples and calls[c][0] is not None:
            m = calls[c][0].shape[0] // self.rows
            chunk = calls[c:c + steps]
            if m < 1 or len(chunk) < steps or not all(self._fed(latents, all_latents[row:row + m, k])
                                                      for k, (latents, _) in enumerate(chunk)):
                break
            chunks.append(torch.stack([torch.stack(per_sample(out, m)) for _, out in chunk], dim=1))
            row, c = row + m, c + steps
        if row != num_samples or c != len(calls):
            warnings.warn(f"jagg_patch.upstream: the rollout's {len(calls)} transformer calls do not match its "
                          f"{num_samples} x {steps} stored latents, so its outputs are not reused this step (the "
                          "middle members are forwarded without grad instead)", stacklevel=2)
            return None
        return torch.cat(chunks)

    def _fed(self, latents, stored):
        """Each of the call's `rows` blocks begins with the stored latents, in every axis."""
        m = stored.shape[0]
        if latents is None or latents.ndim != stored.ndim or latents.shape[0] != self.rows * m:
            return False
        if any(a < b for a, b in zip(latents.shape[1:], stored.shape[1:])):
            return False
        head = tuple(slice(0, n) for n in stored.shape[1:])
        return all(torch.equal(latents[(slice(r * m, (r + 1) * m), *head)].to(stored.dtype), stored)
                   for r in range(self.rows))
