"""Memory of the policy update, measured rather than assumed.

`ActivationMeter` counts the bytes that autograd keeps for backward (the tensors
packed by saved-tensor hooks), so the number is the same on CPU and GPU and does
not depend on the allocator. Each storage is counted once however many ops save
it, from the first save until the last graph holding it is freed. Parameters and
views of them are not activations and are left out.
"""
import torch

MB = 2 ** 20


class _Saved:
    """What autograd stores instead of the tensor; its release ends the tensor's count."""
    __slots__ = ("tensor", "meter", "key")

    def __init__(self, tensor, meter, key):
        self.tensor, self.meter, self.key = tensor, meter, key

    def __del__(self):
        self.meter._release(self.key)


def _is_parameter(t):
    base = t._base if t._base is not None else t
    return isinstance(base, torch.nn.Parameter)


def _storage_key(t):
    """(key, bytes) of the memory behind t; a tensor without a plain storage counts itself."""
    try:
        storage = t.untyped_storage()
        return (t.device, storage.data_ptr()), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # e.g. tensor subclasses without storage
        return ("id", id(t)), t.numel() * t.element_size()


class ActivationMeter:
    """Re-entrant context manager: peak live bytes of saved-for-backward tensors while active.

        meter = ActivationMeter()
        with meter: loss.backward() ...     # may be entered many times; the peak spans them
        meter.peak_bytes; meter.reset()
    """

    def __init__(self):
        self.live_bytes = self.peak_bytes = 0
        self._held = {}  # storage key -> [bytes, number of saved references]
        self._hooks = []

    def reset(self):
        """Start a new peak from what is alive now."""
        self.peak_bytes = self.live_bytes

    @property
    def peak_mb(self):
        return self.peak_bytes / MB

    def __enter__(self):
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        hooks.__enter__()
        self._hooks.append(hooks)
        return self

    def __exit__(self, *exc):
        self._hooks.pop().__exit__(*exc)

    def _pack(self, t):
        if _is_parameter(t):
            return t
        key, nbytes = _storage_key(t)
        entry = self._held.setdefault(key, [nbytes, 0])
        if entry[1] == 0:
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        entry[1] += 1
        # Detached: holding an op's output itself would close a cycle (output -> grad_fn ->
        # saved -> output) that keeps the graph alive; autograd only needs the data back.
        return _Saved(t.detach(), self, key)

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, _Saved) else packed

    def _release(self, key):
        entry = self._held.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.live_bytes -= entry[0]
            del self._held[key]


def cuda_peak_reset(device):
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def cuda_peak_mb(device):
    """torch.cuda.max_memory_allocated since the last reset, or None off CUDA."""
    if torch.device(device).type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / MB
