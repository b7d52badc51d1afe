"""The default engine: the plain model in one process, FSDP1 as upstream under torchrun.

Its optimizer state is saved sharded (utils.optimizer_shards); checkpoints of earlier
versions, which held it whole inside training_state.pt, still load."""
import os

from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_optimizer_state_dict

from ..errors import ConfigError
from ..utils.fsdp_util import (apply_activation_checkpointing, clean_param_name, clip_grad_norm, resolve_weight_type,
                               wrap_fsdp)
from ..utils import optimizer_shards
from ..utils.checkpoint import OPTIMIZER_DIR
from .base import Engine, build_optimizer


def _full_options(model):
    # Offloading to CPU while gathering segfaults with FSDP1 on CPU-only runs; on GPU it saves memory.
    on_gpu = any(p.is_cuda for p in model.parameters())
    return StateDictOptions(full_state_dict=True, cpu_offload=on_gpu)


def full_model_state(model, trainable_only=False):
    """Unsharded, prefix-free state dict (collective under FSDP: call on every rank); with
    trainable_only, only the parameters that require grad (a LoRA adapter, not its frozen base)."""
    # A copy, not a view: on CPU .cpu() would alias the live parameters, and the EMA
    # checkpoint swaps its values in only while the state is read.
    options = _full_options(model)
    options.ignore_frozen_params = trainable_only
    state = get_model_state_dict(model, options=options)
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state.items()}


def prepare_transformer(args, family, transformer, device, world_size, weight_type):
    """FSDP under torchrun, plain module otherwise; activation checkpointing if asked.
    A single process has nothing to reduce: bf16 there is the loop's autocast."""
    blocks = family.block_classes(transformer)
    transformer.train()
    if world_size > 1:
        model = wrap_fsdp(transformer, blocks, device, args.fsdp_sharding_startegy, args.use_cpu_offload,
                          weight_type)
    else:
        model = transformer.to(device)
    if args.gradient_checkpointing and args.selective_checkpointing > 0:
        apply_activation_checkpointing(model, blocks, args.selective_checkpointing)
    return model


def check_cpu_offload(args):
    """--use_cpu_offload moves parameters off a GPU: without one there is nothing to move (FSDP1
    would fail at the first forward)."""
    import torch
    if args.use_cpu_offload and not torch.cuda.is_available():
        raise ValueError(f"--use_cpu_offload with --engine {args.engine} on a machine without a GPU: the parameters "
                         "are on the CPU already; drop the flag")


class FSDPEngine(Engine):
    name = "fsdp"
    banner_name = "FSDP"

    def __init__(self, model, optimizer, lr_scheduler, max_grad_norm, sharded=False, weight_type="fp32"):
        self.model, self.ema_module = model, model
        self.optimizer, self.lr_scheduler = optimizer, lr_scheduler
        self.max_grad_norm, self.sharded, self._weight_type = max_grad_norm, sharded, weight_type

    @classmethod
    def validate_args(cls, args):
        if args.deepspeed_config:
            raise ValueError("--deepspeed_config is given but --engine is fsdp; add --engine deepspeed")
        check_cpu_offload(args)

    @classmethod
    def build(cls, args, family, raw, device, world_size):
        weight_type = (resolve_weight_type(args.master_weight_type, family.gpu_fsdp_weight_type, device,
                                           args.mixed_precision) if world_size > 1 else "fp32")
        model = prepare_transformer(args, family, raw, device, world_size, weight_type)
        optimizer, scheduler = build_optimizer(args, model)
        return cls(model, optimizer, scheduler, args.max_grad_norm, sharded=world_size > 1, weight_type=weight_type)

    @property
    def weight_type(self):
        return self._weight_type

    def clip(self, model, max_norm):
        """The total grad norm before clipping, every shard seen."""
        return clip_grad_norm(model, max_norm)

    def optimizer_step(self, check_norm):
        norm = self.clip(self.model, self.max_grad_norm)
        check_norm(norm)   # before the step: a non-finite norm never reaches the weights
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def full_state(self, trainable_only=False):
        return full_model_state(self.model, trainable_only)

    def save_state(self, folder):
        optimizer_shards.save_optimizer(self.model, self.optimizer, os.path.join(folder, OPTIMIZER_DIR))

    def load_state(self, folder, saved):
        """Parameters that never received a gradient (e.g. Qwen-Image's last text-stream output
        projection) have no AdamW state when saved and stay without it; state naming parameters
        the model lacks is refused."""
        shards = os.path.join(folder, OPTIMIZER_DIR)
        sharded = os.path.isdir(shards)
        have = (optimizer_shards.saved_parameters(shards) if sharded
                else set(saved["optimizer"].get("state", {})))
        unknown = sorted(have - {clean_param_name(n) for n, _ in self.model.named_parameters()})
        if unknown:
            raise ConfigError(f"Checkpoint {folder!r} holds optimizer state for parameters this model lacks "
                              f"({unknown[:3]}); it belongs to another model or adapter setup")
        if sharded:
            optimizer_shards.load_optimizer(self.model, self.optimizer, shards)
        else:
            set_optimizer_state_dict(self.model, self.optimizer, optim_state_dict=saved["optimizer"],
                                     options=StateDictOptions(full_state_dict=True, strict=False))

    def label(self):
        return f" ({self.banner_name} {self._weight_type})" if self.sharded else ""

    def state_setup(self, adapter):
        return adapter.memory_setup


def plain_engine(model, args):
    """A single-process engine around an already built model (tools and tests that hold one)."""
    optimizer, scheduler = build_optimizer(args, model)
    return FSDPEngine(model, optimizer, scheduler, args.max_grad_norm)

