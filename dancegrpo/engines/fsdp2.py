"""--engine fsdp2: torch's per-parameter sharding (`torch.distributed.fsdp.fully_shard`, FSDP2)
under torchrun; the plain model in one process, as --engine fsdp.

`fully_shard` goes on every transformer block (the units upstream's FSDP1 wrap policy makes) and
then on the root, which holds the rest. Parameters become DTensors sharded on dim 0; there is no
flat parameter, so frozen and trainable parameters (LoRA) share a unit freely, and the state dict
helpers (torch.distributed.checkpoint.state_dict) read and write them as FSDP1's. A checkpoint is
therefore the same on both engines: the full diffusers weights, written by rank 0, and the AdamW
state sharded by parameter name (dancegrpo.utils.optimizer_shards), which either engine reshards
on load.

The flags map as follows:
- --master_weight_type bf16: MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=float32): the
  forward / backward in bf16 parameters, the gradient reduce-scatter in float32 (FSDP1 as upstream
  sets it reduces in bf16: one of the two differences a bf16 run shows between the engines); fp32:
  float32 throughout. The sharded parameters, and so AdamW's state, stay in the loaded dtype.
- --fsdp_sharding_startegy full: reshard after forward (FULL_SHARD); hybrid_full / hybrid_zero2: a
  2-D mesh (nodes x ranks per node), replicated across nodes and sharded within one, resharding
  after forward or not (ZeRO-2); none has no FSDP2 form (use --engine fsdp).
- --use_cpu_offload: CPUOffloadPolicy (GPU only: on a CPU run the parameters are on the CPU already).
"""
import os

import torch

from ..errors import ConfigError
from ..utils.command_line import flag_as_typed
from ..utils.fsdp_util import apply_activation_checkpointing, broadcast_module_states, resolve_weight_type
from .base import build_optimizer
from .fsdp import FSDPEngine, check_cpu_offload
from .probe import GradProbe

# --fsdp_sharding_startegy -> (a 2-D mesh, reshard after forward)
SHARDING = {"full": (False, True), "hybrid_full": (True, True), "hybrid_zero2": (True, False)}


def mixed_precision_policy(weight_type, root):
    """The unit's policy. What a unit is given is cast as FSDP1 casts it: by the root alone, and only
    to bf16 parameters. A block that cast its inputs would lift the bf16 activations of an autocast
    run back to float32 between blocks (a gradient 8% off the single-process bf16 one, measured); a
    root that cast to float32 would lift the rollout's bf16 latents (another rollout than FSDP1's:
    its reward differed in the fourth digit, measured)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    dtype = torch.bfloat16 if weight_type == "bf16" else torch.float32
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32,
                                cast_forward_inputs=root and weight_type == "bf16")


def device_mesh(device, hybrid, world_size):
    """1-D over every rank, or (nodes, ranks per node) for the hybrid strategies. The 1-D mesh is the
    default process group itself: a group of its own would outlive destroy_process_group while the
    sharded model holds it, its gloo threads running into the interpreter's teardown."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    kind = torch.device(device).type
    if not hybrid:
        return DeviceMesh.from_group(dist.group.WORLD, kind)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if world_size % per_node:
        raise ConfigError(f"--fsdp_sharding_strategy hybrid needs the same ranks on every node: {world_size} ranks "
                          f"do not split into nodes of {per_node}")
    return init_device_mesh(kind, (world_size // per_node, per_node), mesh_dim_names=("replicate", "shard"))


def shard_units(model, blocks):
    """The modules fully_shard goes on: each of `blocks`, or its activation-checkpoint wrapper where it
    has one (the wrapper's forward is what the parent calls)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    wrappers = {id(m._checkpoint_wrapped_module): m for m in model.modules() if isinstance(m, CheckpointWrapper)}
    return [wrappers.get(id(block), block) for block in blocks]


def shard_transformer(args, family, transformer, device, world_size, weight_type):
    """fully_shard on every block and on the root (activation checkpointing applied first, as torchtitan
    does); every rank starts from rank 0's weights."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    block_classes = tuple(family.block_classes(transformer))
    blocks = [m for m in transformer.modules() if isinstance(m, block_classes)]
    transformer.train()
    transformer.to(device)
    broadcast_module_states(transformer)
    if args.gradient_checkpointing and args.selective_checkpointing > 0:
        apply_activation_checkpointing(transformer, block_classes, args.selective_checkpointing)
    hybrid, reshard = SHARDING[args.fsdp_sharding_startegy]
    options = {"mesh": device_mesh(device, hybrid, world_size), "reshard_after_forward": reshard}
    if args.use_cpu_offload:
        options["offload_policy"] = CPUOffloadPolicy()
    for unit in shard_units(transformer, blocks):   # innermost first: the root takes what they leave
        fully_shard(unit, mp_policy=mixed_precision_policy(weight_type, root=False), **options)
    fully_shard(transformer, mp_policy=mixed_precision_policy(weight_type, root=True), **options)
    return transformer


def clip_grad_norm(model, max_norm):
    """The total norm of the full gradient before clipping: torch's clip over the DTensor gradients
    reduces each shard's norm over the mesh, as FSDP1's own clip does over flat shards."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


class LocalShardProbe(GradProbe):
    """GradProbe over DTensor gradients: each rank's local shard, whose dot products summed over ranks
    are the full gradient's."""

    def take(self):
        return [g.to_local() if hasattr(g, "to_local") else g for g in super().take()]


class FSDP2Engine(FSDPEngine):
    name = "fsdp2"

    @classmethod
    def validate_args(cls, args):
        if args.deepspeed_config:
            raise ValueError("--deepspeed_config is given but --engine is fsdp2; add --engine deepspeed")
        check_cpu_offload(args)
        if args.fsdp_sharding_startegy not in SHARDING:
            flag = flag_as_typed(args, "fsdp_sharding_startegy", "--fsdp_sharding_strategy")
            raise ValueError(f"{flag} {args.fsdp_sharding_startegy} has no FSDP2 form (FSDP2 "
                             f"shards: {', '.join(SHARDING)}); use --engine fsdp for NO_SHARD")

    @classmethod
    def build(cls, args, family, raw, device, world_size):
        if world_size == 1:   # nothing to shard: the plain model, as --engine fsdp builds it
            return super().build(args, family, raw, device, world_size)
        weight_type = resolve_weight_type(args.master_weight_type, family.gpu_fsdp_weight_type, device,
                                          args.mixed_precision)
        model = shard_transformer(args, family, raw, device, world_size, weight_type)
        optimizer, scheduler = build_optimizer(args, model)
        return cls(model, optimizer, scheduler, args.max_grad_norm, sharded=True, weight_type=weight_type)

    banner_name = "FSDP2"

    def clip(self, model, max_norm):
        return clip_grad_norm(model, max_norm)

    def gradient_probe(self):
        return LocalShardProbe(p for p in self.model.parameters() if p.requires_grad)
