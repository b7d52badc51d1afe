"""How close an approximate gradient is to the exact one: the one fidelity measure of the monitor
and the tools (cosine and relative error, in float64)."""
from typing import NamedTuple

import torch

NAN = float("nan")


class Similarity(NamedTuple):
    cos: float          # nan where either gradient is zero: no direction to compare
    relerr: float       # |approx - exact| / |exact|; nan where exact is zero
    exact_norm: float


def _sum_over_ranks(t):
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t)
    return t


def gradient_similarity(exact, approx, over_ranks=True):
    """The Similarity of two gradients given as lists of tensors (a None entry of `approx` is a zero
    gradient).

    Reduced tensor by tensor in float64, so no flat copy of the gradient is made; over_ranks: the
    lists hold this rank's part (its FSDP shard, its slice of an all-reduced mean) and the dot
    products are summed over ranks, in one collective and one host sync."""
    device = exact[0].device if exact else torch.device("cpu")
    sums = torch.zeros(4, dtype=torch.float64, device=device)   # e.a, a.a, e.e, (e-a).(e-a)
    for e, a in zip(exact, approx):
        e = e.double()
        a = torch.zeros_like(e) if a is None else a.double()
        sums += torch.stack([(e * a).sum(), (a * a).sum(), (e * e).sum(), ((e - a) ** 2).sum()])
    if over_ranks:
        sums = _sum_over_ranks(sums)
    ea, aa, ee, dd = sums.tolist()
    cos = ea / (ee * aa) ** 0.5 if ee > 0 and aa > 0 else NAN
    return Similarity(cos, (dd / ee) ** 0.5 if ee > 0 else NAN, ee ** 0.5)
