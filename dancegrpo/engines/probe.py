"""Gradient probes: a measurement's gradients, taken beside the step's own without touching it
(jagg_patch's monitor compares the exact gradient of a group with JAGG's this way).

A probe is a context manager. Inside it, `backward(outputs, grads)` (torch.autograd.backward's
contract) backpropagates the measurement's passes, and `take()` returns the gradient of the
backwards since the previous take as this rank's part of the ranks' mean gradient: a list of
tensors whose dot products, summed over ranks, are those of the full gradient. The step's own
gradient is the same, tensor for tensor, after the probe as before it.

GradProbe is for engines whose backward leaves each rank's part in the parameters' .grad (one
process, FSDP: there it is this rank's shard of the mean after the reduce-scatter). AutogradProbe
is for engines that keep the step's gradient in buffers of their own (DeepSpeed ZeRO): it takes the
gradient with torch.autograd.grad, so the engine's accumulation hooks never run, and averages it
over ranks itself.
"""
import contextlib

import torch


def _ranks():
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class GradProbe:
    """The measurement's gradient in fresh .grad tensors; the step's own are put back on exit."""

    def __init__(self, params):
        self.params = list(params)
        self._saved = None

    def __enter__(self):
        self._saved = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        return self

    def __exit__(self, *exc):
        for p, g in zip(self.params, self._saved):
            p.grad = g
        self._saved = None
        return False

    def backward(self, outputs, grads=None):
        torch.autograd.backward(outputs, grads)

    def take(self):
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        return grads


class AutogradProbe:
    """The measurement's gradient by torch.autograd.grad into a buffer of its own, averaged over
    ranks by one all-reduce per take (each rank holds the whole parameters, as under ZeRO's
    replicated or gathered weights); each rank keeps its slice of the mean, so the summed dot
    products count every element once. Memory: one flat copy of the trainable gradient while
    accumulating, and a 1/world slice per gradient taken."""

    def __init__(self, params, context=None):
        """context: entered for the measurement (an engine's way to keep its own hooks out of it)."""
        self.params = list(params)
        self._context = context if context is not None else contextlib.nullcontext()
        self._sums = None

    def __enter__(self):
        self._sums = None
        self._context.__enter__()
        return self

    def __exit__(self, *exc):
        self._sums = None
        return self._context.__exit__(*exc)

    def backward(self, outputs, grads=None):
        got = torch.autograd.grad(outputs, self.params, grads, allow_unused=True)
        flat = torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1).float()
                          for p, g in zip(self.params, got)])
        self._sums = flat if self._sums is None else self._sums + flat

    def take(self):
        total = self._sums if self._sums is not None else torch.zeros(
            sum(p.numel() for p in self.params), device=self.params[0].device)
        self._sums = None
        rank, world = _ranks()
        if world > 1:
            import torch.distributed as dist
            dist.all_reduce(total)
            total = total / world
        return [torch.tensor_split(total, world)[rank]]
