"""Process group and collectives. Works on CPU (gloo) and CUDA (nccl)."""
import atexit
import gc
import os
import sys

import torch
import torch.distributed as dist

from .launch import launch_rank, launch_world_size, print_on_rank0  # noqa: F401  (part of this module's API)


def init_distributed():
    """Join the torchrun process group if there is one. Returns (rank, world_size, local_rank, device)."""
    world_size, rank = launch_world_size(), launch_rank()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        # Whatever way the process ends (an error, a signal's exit, a tool that never calls shutdown),
        # the group is released before the interpreter tears down.
        atexit.register(release_process_group)
    return rank, world_size, local_rank, device


def is_distributed():
    return dist.is_available() and dist.is_initialized()


def world_size():
    """The ranks of the process group (1 without one)."""
    return dist.get_world_size() if is_distributed() else 1


def barrier():
    if is_distributed():
        dist.barrier()


def shutdown():
    """The end of a run that every rank reached: a barrier (no rank tears down while another still
    talks to it), then the process group released."""
    if is_distributed():
        dist.barrier()
    release_process_group()


# What gloo says when the process on the other end of a collective is gone (killed, crashed).
PEER_GONE = ("Connection closed by peer", "Connection reset by peer")


def peer_lost(error):
    """What the backend said if `error` is a collective's failure because another rank's process
    ended, else None."""
    if not (is_distributed() and isinstance(error, RuntimeError)):
        return None
    return next((s for s in PEER_GONE if s in str(error)), None)


def release_process_group():
    """Destroy the default process group, then collect the garbage that still holds it. FSDP units and
    their hooks keep the group in reference cycles after destroy_process_group(); left to interpreter
    exit, gloo's threads (gloo_tcp_loop, pt_gloo_runloop) are still running while the process tears
    down, and now and then it aborts there ("terminate called without an active exception", exit -6,
    after the run had finished). Collected here, the group's destructor joins them at once. The last
    unhandled exception's traceback (sys.last_*) holds the frames that hold the model: dropped first."""
    if is_distributed():
        dist.destroy_process_group()
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            setattr(sys, name, None)
    gc.collect()


def decide_on_rank0(fn, rank):
    """Rank 0 runs fn(); every rank returns its result, or raises what it raised (a ConfigError
    as such, anything else as RuntimeError on the other ranks).

    For the choices made before loading (output folder, which checkpoint, seed) that every
    rank must share and that only one process may make."""
    from ..errors import ConfigError
    result, error = None, None
    if rank == 0:
        try:
            result = fn()
        except Exception as e:  # any failure: the other ranks must not wait at the broadcast forever
            if not is_distributed():
                raise
            error = e
    if is_distributed():
        box = [(result, None if error is None else (isinstance(error, ConfigError), str(error)))]
        dist.broadcast_object_list(box, src=0)
        result, err = box[0]
        if err is not None:
            if rank == 0:
                raise error
            raise (ConfigError if err[0] else RuntimeError)(err[1])
    return result


def gather_tensor(tensor):
    """Concatenate a tensor from every rank along dim 0 (identity when not distributed)."""
    if not is_distributed():
        return tensor
    parts = [torch.zeros_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor.contiguous())
    return torch.cat(parts, dim=0)


def _all_reduce_float(value, device, op):
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return t.item()


def all_reduce_mean(value, device):
    """Average a Python float over ranks."""
    if not is_distributed():
        return float(value)
    return _all_reduce_float(value, device, dist.ReduceOp.SUM) / dist.get_world_size()


def sum_over_ranks(counts, device):
    """{name: integer count} summed over ranks, in one collective (a metrics record's counts are the
    whole step's, every rank's passes)."""
    if not is_distributed():
        return dict(counts)
    t = torch.tensor([float(v) for v in counts.values()], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return {name: int(round(x)) for name, x in zip(counts, t.tolist())}


def all_reduce_max(value, device):
    """The largest of a Python float over ranks."""
    return _all_reduce_float(value, device, dist.ReduceOp.MAX) if is_distributed() else float(value)
