"""FSDP1 as upstream wraps the transformer: sharding, mixed precision, activation checkpointing,
clipping and the names and gradients of wrapped parameters."""
import contextlib
import functools

import torch
import torch.distributed as dist

from .communications import is_distributed
from ..choices import SHARDING_STRATEGIES


def resolve_weight_type(requested, family_gpu_default, device, mixed_precision=None):
    """--master_weight_type, or the family's upstream choice where the run computes in reduced
    precision (GPU, or CPU with --mixed_precision bf16: gloo reduces bf16 too); a float32 CPU run
    stays fp32."""
    from .precision import compute_dtype
    if requested:
        return requested
    reduced = torch.device(device).type == "cuda" or compute_dtype(device, mixed_precision) is not None
    return family_gpu_default if reduced else "fp32"


def fsdp_mixed_precision(weight_type):
    """Upstream's FSDP MixedPrecision for --master_weight_type: every dtype (parameters in
    forward / backward, gradient reduction, buffers) is fp32 or bf16. FSDP keeps its sharded
    parameters, and so the optimizer state, in the dtype the model was loaded in (fp32)."""
    from torch.distributed.fsdp import MixedPrecision
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[weight_type]
    return MixedPrecision(param_dtype=dtype, reduce_dtype=dtype, buffer_dtype=dtype)


def wrap_fsdp(transformer, block_classes, device, sharding="full", cpu_offload=False, weight_type="fp32"):
    """FSDP1 as upstream: each transformer block is a unit, FULL_SHARD by default, the
    precision of `fsdp_mixed_precision(weight_type)`."""
    from torch.distributed.fsdp import CPUOffload, FullyShardedDataParallel as FSDP, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    strategy = {"full": ShardingStrategy.FULL_SHARD, "hybrid_full": ShardingStrategy.HYBRID_SHARD,
                "hybrid_zero2": ShardingStrategy._HYBRID_SHARD_ZERO2, "none": ShardingStrategy.NO_SHARD}
    if sharding not in strategy:
        raise ValueError(f"--fsdp_sharding_startegy {sharding!r}: choose one of {SHARDING_STRATEGIES}")
    # FSDP1 (torch 2.14) refuses sync_module_states for CPU tensors even with device_id=cpu,
    # so on CPU the same rank-0 broadcast is done here before wrapping.
    on_cpu = torch.device(device).type == "cpu"
    if on_cpu:
        broadcast_module_states(transformer)
    return FSDP(transformer, auto_wrap_policy=ModuleWrapPolicy(set(block_classes)),
                sharding_strategy=strategy[sharding], cpu_offload=CPUOffload(offload_params=cpu_offload),
                device_id=device, sync_module_states=not on_cpu, limit_all_gathers=True,
                mixed_precision=fsdp_mixed_precision(weight_type),
                # Original parameters stay visible: summon_full_params(with_grads=True) needs them.
                use_orig_params=True)


def broadcast_module_states(module, src=0):
    """Every rank gets rank `src`'s parameters and buffers (what FSDP's sync_module_states does)."""
    if not is_distributed():
        return
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.data, src=src)


def selected_blocks(model, block_classes, fraction):
    """Upstream's selective checkpointing: walking the blocks in module order with i = 1, 2, ...,
    block i is recomputed when i * fraction >= cut_off (cut_off starts at 1/2 and rises by one at
    each pick), which spreads round(fraction * n) blocks through the stack (0.5: every second)."""
    chosen, cut_off = set(), 0.5
    blocks = [m for m in model.modules() if isinstance(m, tuple(block_classes))]
    for i, block in enumerate(blocks, start=1):
        if i * fraction >= cut_off:
            chosen.add(id(block))
            cut_off += 1
    return chosen


def apply_activation_checkpointing(model, block_classes, fraction=1.0):
    """Recompute a fraction of the blocks in backward (non-reentrant, works under FSDP and plain)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                                                                             CheckpointImpl, apply_activation_checkpointing as _apply, checkpoint_wrapper)
    chosen = selected_blocks(model, block_classes, fraction)
    _apply(model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper,
                                                          checkpoint_impl=CheckpointImpl.NO_REENTRANT),
           check_fn=lambda m: id(m) in chosen)


def clip_grad_norm(model, max_norm):
    """Total grad norm before clipping; FSDP needs its own method to see every shard."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    if isinstance(model, FSDP):
        return float(model.clip_grad_norm_(max_norm))
    params = [p for p in model.parameters() if p.grad is not None]
    return float(torch.nn.utils.clip_grad_norm_(params, max_norm))


def clean_param_name(name):
    """Parameter name without the FSDP / activation-checkpoint wrapper prefixes."""
    return name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")


def full_gradients(model):
    """{name: unsharded gradient} of the trainable parameters of a plain, FSDP1 or FSDP2 model
    (collective under FSDP)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    ctx = FSDP.summon_full_params(model, with_grads=True) if isinstance(model, FSDP) else contextlib.nullcontext()
    with ctx:
        return {clean_param_name(n): _unsharded(p.grad if p.grad is not None else torch.zeros_like(p))
                for n, p in model.named_parameters() if p.requires_grad}


def _unsharded(tensor):
    """A copy of the whole tensor: an FSDP2 DTensor gathered (collective), any other cloned."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor.detach().clone()
