"""Where a flush is triggered: before every gradient clip (torch's clip_grad_norm_ / clip_grad_value_,
a model's own clip_grad_norm_ such as FSDP's, a GradScaler's unscale_, which accelerate's clip runs
first) and before every real optimizer step (accelerate's wrapped optimizer steps the real one on
sync steps only); after the step the rollout's outputs are stale. The real optimizer's zero_grad
drops what is pending, as it would drop vanilla's accumulated gradient.

The clip patches are process-wide (a loop may clip with any of them) and flush every live proxy; they
are installed while a proxy lives and removed with the last one.
"""
import functools
import weakref

import torch

from .errors import DeferredError

_LIVE = []      # weak references to the live proxies, in the order they were made (the same on every rank)
_PATCHED = {}   # (owner, attribute) -> the original


def _flush_all():
    for ref in list(_LIVE):
        proxy = ref()
        if proxy is not None:
            proxy.flush()


def _flushing(fn):
    @functools.wraps(fn)
    def flushed_first(*args, **kwargs):
        _flush_all()
        return fn(*args, **kwargs)
    return flushed_first


def _global_targets():
    import torch.nn.utils.clip_grad as clip_grad
    targets = [(torch.nn.utils, "clip_grad_norm_"), (torch.nn.utils, "clip_grad_value_"),
               (clip_grad, "clip_grad_norm_"), (clip_grad, "clip_grad_value_"),
               (torch.amp.grad_scaler.GradScaler, "unscale_")]
    try:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
        if "unscale_" in vars(ShardedGradScaler):
            targets.append((ShardedGradScaler, "unscale_"))
    except ImportError:
        pass
    return targets


def register(proxy):
    """A live proxy: the process-wide clip patches are installed with the first."""
    if not _PATCHED:
        for owner, name in _global_targets():
            original = getattr(owner, name)
            _PATCHED[(owner, name)] = original
            setattr(owner, name, _flushing(original))
    _LIVE.append(weakref.ref(proxy))


def unregister(proxy):
    _LIVE[:] = [ref for ref in _LIVE if ref() is not None and ref() is not proxy]
    if not _LIVE:
        for (owner, name), original in _PATCHED.items():
            setattr(owner, name, original)
        _PATCHED.clear()


def patch_model_clip(model):
    """A model's own clip_grad_norm_ (FSDP1's, or a wrapper's, anywhere along its .module chain)
    flushes first; returns the objects patched, for unpatch_model_clip."""
    patched, seen, current = [], set(), model
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        method = getattr(type(current), "clip_grad_norm_", None)
        if callable(method) and "clip_grad_norm_" not in vars(current):
            current.__dict__["clip_grad_norm_"] = _flushing(getattr(current, "clip_grad_norm_"))
            patched.append(current)
        inner = getattr(current, "module", None)
        current = inner if isinstance(inner, torch.nn.Module) else None
    return patched


def unpatch_model_clip(patched):
    for obj in patched:
        obj.__dict__.pop("clip_grad_norm_", None)


def real_optimizer(optimizer):
    """The torch optimizer that steps the parameters: the innermost of a wrapper's .optimizer chain
    (accelerate's AcceleratedOptimizer subclasses torch's Optimizer without running its __init__, so
    hooks go on the optimizer it holds)."""
    seen = set()
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer) and id(optimizer) not in seen:
        seen.add(id(optimizer))
        optimizer = optimizer.optimizer
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise DeferredError(f"jagg_patch.deferred: {type(optimizer).__name__} is no torch optimizer and holds none as "
                            ".optimizer; attach the torch.optim.Optimizer that steps the model's parameters")
    return optimizer


class OptimizerHooks:
    """The hooks of one attached optimizer: flush before its step, the record stale after it,
    pending rows dropped by its zero_grad."""

    def __init__(self, optimizer, proxy):
        self.optimizer = real_optimizer(optimizer)
        ref = weakref.ref(proxy)
        self.handles = [self.optimizer.register_step_pre_hook(lambda *a: _call(ref, "flush")),
                        self.optimizer.register_step_post_hook(lambda *a: _call(ref, "note_step"))]
        original = self.optimizer.zero_grad

        @functools.wraps(original)
        def zero_grad(*args, **kwargs):
            _call(ref, "drop_pending")
            return original(*args, **kwargs)
        self.optimizer.zero_grad = zero_grad

    def remove(self):
        for handle in self.handles:
            handle.remove()
        self.optimizer.__dict__.pop("zero_grad", None)


def _call(ref, method):
    proxy = ref()
    if proxy is not None:
        getattr(proxy, method)()
