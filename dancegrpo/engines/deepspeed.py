"""DeepSpeed ZeRO as the engine (`--engine deepspeed --deepspeed_config FILE`), instead of FSDP.

The loop stays the loop: it gets the engine as its model (predict calls it like the module),
the update's backward through `backward` (the engine wants ONE `engine.backward(scalar)` per
pass: a pass with upstream gradients [g_e] on outputs [v_e] becomes the surrogate scalar
sum_e <v_e, g_e> with g_e detached, whose gradient is exactly sum_e J_e^T g_e, so the JAGG
joint backward is still one backward), and the optimizer step through `optimizer_step` (the
engine clips with `gradient_clipping` and steps; the client scheduler then steps).

The optimizer is a client torch AdamW (nothing of DeepSpeed's is compiled for it;
`zero_allow_untested_optimizer` is set). Each backward is its own micro step of the engine
(train_micro_batch_size_per_gpu 1, gradient_accumulation_steps 1, no loss scaling by GA); the
trainer decides when to step: after every --gradient_accumulation_steps samples, upstream's
cadence. Gradients are averaged over ranks, as FSDP does. On CPU fp16 in the config is turned off,
and bf16 too unless the run computes in bf16 (--mixed_precision bf16). Checkpoints: the engine's own
sharded state in checkpoint-*/deepspeed/ for resume, plus the same diffusers transformer/ (or LoRA)
files as FSDP.
"""
import contextlib
import gc
import json
import os

import torch

from ..errors import ConfigError
from ..utils.fsdp_util import apply_activation_checkpointing
from ..utils.launch import print_on_rank0
from ..utils.precision import compute_dtype
from .base import Engine, build_optimizer

TAG = "deepspeed"  # the sub-folder of a checkpoint-STEP-EPOCH folder that holds the engine's state


def read_config(path):
    if not path:
        raise ValueError("--engine deepspeed needs --deepspeed_config FILE (e.g. configs/deepspeed/zero2.json)")
    try:
        with open(path) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"--deepspeed_config {path!r} does not exist") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--deepspeed_config {path!r} is not valid JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(config, dict):
        raise ValueError(f"--deepspeed_config {path!r} must hold a JSON object")
    stage = zero_stage(config)
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"--deepspeed_config {path!r}: zero_optimization.stage must be 0-3, got {stage!r}")
    zero = config.get("zero_optimization", {})
    for key in ("offload_optimizer", "offload_param"):
        if zero.get(key, {}).get("device", "none") not in ("none", None):
            raise ValueError(f"--deepspeed_config {path!r}: {key} needs DeepSpeed's compiled CPU Adam; this trainer "
                             "uses a client torch AdamW - remove zero_optimization.{key}")
    return config


def zero_stage(config):
    return config.get("zero_optimization", {}).get("stage", 0)


def engine_config(settings, args, device):
    """The user's config with what this trainer decides: micro steps, clipping, precision on CPU."""
    config = json.loads(json.dumps(settings))
    config.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1,
                  zero_allow_untested_optimizer=True, steps_per_print=10 ** 9)
    config["gradient_clipping"] = float(args.max_grad_norm) if args.max_grad_norm else 0.0
    config.pop("train_batch_size", None)
    if device.type != "cuda":
        # CPU: no fp16 (no loss scaling here); the config's bf16 only where the run computes in bf16
        # (--mixed_precision bf16), else a float32 run.
        dropped = [key for key in ("fp16", "bf16") if (config.get(key) or {}).get("enabled")]
        config["fp16"] = {"enabled": False}
        if compute_dtype(device, args.mixed_precision) != torch.bfloat16:
            config["bf16"] = {"enabled": False}
        dropped = [key for key in dropped if not config[key]["enabled"]]
        if dropped:
            print_on_rank0(f"notice: the DeepSpeed config's {' and '.join(dropped)} is turned off on CPU (no loss "
                           "scaling here; bf16 only with --mixed_precision bf16): the engine holds float32 weights "
                           "and gradients")
    return config


def _ensure_process_group():
    """deepspeed.init_distributed, in a single process too (a world of one: it reads RANK /
    WORLD_SIZE / MASTER_*); under torchrun it adopts the trainer's process group. Returns the
    environment variables it set (close() takes them back)."""
    import deepspeed
    import torch.distributed as dist
    added = []
    if not dist.is_initialized():
        port = str(29500 + os.getpid() % 2000)  # single processes side by side must not share a port
        for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                           ("MASTER_PORT", port)):
            if key not in os.environ:
                os.environ[key] = value
                added.append(key)
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    return added


class DeepSpeedEngine(Engine):
    """DeepSpeed's engine behind the loop's interface. `model` is the DeepSpeed engine (its
    parameter names carry a module. prefix), so the EMA follows the module inside it."""
    name = "deepspeed"

    def __init__(self, raw, optimizer, lr_scheduler, args, device):
        import deepspeed
        self._added_env = _ensure_process_group()
        self.config = engine_config(args.deepspeed_settings, args, device)
        self.stage = zero_stage(self.config)
        trainable = [p for p in raw.parameters() if p.requires_grad]
        self.engine, *_ = deepspeed.initialize(model=raw, optimizer=optimizer, model_parameters=trainable,
                                               config=self.config)
        self.model, self.ema_module = self.engine, raw
        self.optimizer, self.lr_scheduler = optimizer, lr_scheduler

    @classmethod
    def validate_args(cls, args):
        try:
            import deepspeed  # noqa: F401
        except ImportError:
            raise ValueError("--engine deepspeed needs DeepSpeed: pip install deepspeed==0.19.8") from None
        args.deepspeed_settings = read_config(args.deepspeed_config)
        if args.use_ema and zero_stage(args.deepspeed_settings) == 3:
            raise ValueError("--use_ema is not supported with ZeRO-3 (its parameters are partitioned); use ZeRO-2 "
                             "or FSDP for an EMA run")

    @classmethod
    def build(cls, args, family, raw, device, world_size):
        raw.to(device).train()
        if args.gradient_checkpointing and args.selective_checkpointing > 0:
            apply_activation_checkpointing(raw, family.block_classes(raw), args.selective_checkpointing)
        optimizer, scheduler = build_optimizer(args, raw)
        return cls(raw, optimizer, scheduler, args, device)

    def close(self):
        """Tear the process group down through DeepSpeed, which drops its cached groups with it: a
        second run in the same process (a sweep, a notebook) otherwise broadcasts over the destroyed
        group and fails. The engine's gradient hooks go first (DeepSpeedEngine.destroy): they sit on
        autograd's nodes, outside Python's garbage collector, and kept the engine, hence its groups
        and their gloo threads, alive to interpreter exit. The single-process environment variables
        go too."""
        import deepspeed.comm
        import torch.distributed as dist
        module = self.engine.module
        self.engine.destroy()
        if self.stage == 3:
            _drop_zero3_references(module)
        if dist.is_initialized():
            dist.barrier()  # as dancegrpo.utils.communications.shutdown: no rank tears down early
            deepspeed.comm.destroy_process_group()
        for key in self._added_env:
            os.environ.pop(key, None)
        gc.collect()   # the model <-> hooks <-> engine cycle: its groups' gloo threads end with it, now

    def label(self):
        return f" (DeepSpeed ZeRO-{self.stage} {self.weight_type})"

    def state_setup(self, adapter):
        return f"zero{self.stage}"

    @property
    def weight_type(self):
        """The dtype the engine holds parameters and gradients in: its config's (fp32 on CPU)."""
        for key in ("bf16", "fp16"):
            if (self.config.get(key) or {}).get("enabled"):
                return key
        return "fp32"

    def backward(self, outputs, grads=None):
        """autograd.backward(outputs, grads) as one engine.backward of a scalar; never a gradient
        accumulation boundary (how many passes a block has is the update's business)."""
        if grads is None:
            scalar = sum(o.sum() for o in outputs)
        else:
            scalar = sum((o * g.detach()).sum() for o, g in zip(outputs, grads))
        self.engine.set_gradient_accumulation_boundary(False)
        self.engine.backward(scalar, scale_wrt_gas=False)

    def gradient_probe(self):
        """ZeRO keeps the step's gradient in its own buffers, filled by hooks on the parameters: a
        measurement takes its gradient with autograd.grad instead, past those hooks, and its
        forwards run the module alone (_module_forward)."""
        from .probe import AutogradProbe
        return AutogradProbe((p for p in self.engine.module.parameters() if p.requires_grad), self._module_forward())

    @contextlib.contextmanager
    def _module_forward(self):
        """Calling the engine runs its module alone while this is open. DeepSpeed's own forward hooks
        the engine's backward epilogue (ZeRO's bucket reduction) onto the outputs, which then runs
        after any backward through them, a measurement's too; ZeRO-3's gathering hooks sit on the
        module's blocks and stay. An instance attribute shadows the engine's forward method (set in
        __dict__: Module.__setattr__ would register the module as a child)."""
        self.engine.__dict__["forward"] = self.engine.module.__call__
        try:
            yield
        finally:
            del self.engine.__dict__["forward"]

    def optimizer_step(self, check_norm):
        """Clip (the engine's gradient_clipping) and step; returns the global grad norm before clipping.
        The engine clips inside its step, so `check_norm` sees the norm after it (a non-finite one
        stops the run before any checkpoint is written: the loop checks the weights first).

        The boundary is declared here. ZeRO-1/2 close the accumulation inside a backward at the
        boundary (measured: without one, a second backward replaced the first's gradient), so a
        backward of 0 * parameters flushes them: no model pass, no change to the gradient."""
        self.engine.set_gradient_accumulation_boundary(True)
        if self.stage < 3:
            trainable = [p for p in self.engine.module.parameters() if p.requires_grad]
            self.engine.backward(sum((p * 0).sum() for p in trainable), scale_wrt_gas=False)
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        norm = float(norm) if norm is not None else float("nan")
        check_norm(norm)
        return norm

    def full_state(self, trainable_only=False):
        """Unsharded state dict of the module (collective under ZeRO-3; every rank calls it)."""
        import deepspeed
        module = self.engine.module
        params = [p for p in module.parameters() if p.requires_grad or not trainable_only]
        with deepspeed.zero.GatheredParameters(params, enabled=self.stage == 3):
            named = dict(module.named_parameters())
            state = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in module.state_dict().items()
                     if not trainable_only or (k in named and named[k].requires_grad)}
        return state

    def save_state(self, folder):
        self.engine.save_checkpoint(folder, tag=TAG, save_latest=False,
                                    exclude_frozen_parameters=any(not p.requires_grad
                                                                  for p in self.engine.module.parameters()))

    def load_state(self, folder, saved):
        if not os.path.isdir(os.path.join(folder, TAG)):
            raise ConfigError(f"{folder!r} has no {TAG}/ engine state: resume a DeepSpeed run from a checkpoint of "
                              "a DeepSpeed run (or drop --engine deepspeed)")
        path, _ = self.engine.load_checkpoint(folder, tag=TAG, load_lr_scheduler_states=False,
                                              load_module_strict=False)
        if path is None:
            raise ConfigError(f"DeepSpeed could not load the engine state in {folder!r}/{TAG}")


def _drop_zero3_references(module):
    """ZeRO-3 keeps its engine reachable after DeepSpeedEngine.destroy(), through two module-level
    references (found by walking from sys.modules to the engine): the top module stays on
    parameter_offload.FWD_MODULE_STACK (pushed at setup, never popped), and the parameter
    coordinator's release sets sit in an lru_cache keyed by the coordinator and the submodules. The
    module's hooks hold the engine, the engine its two gloo groups: with both references dropped they
    are garbage, and their threads end with the run instead of at interpreter exit."""
    from deepspeed.runtime.zero import parameter_offload
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator
    stack = parameter_offload.FWD_MODULE_STACK
    stack[:] = [m for m in stack if m is not module]
    release = vars(PartitionedParameterCoordinator).get("_PartitionedParameterCoordinator__params_to_release")
    for cell in getattr(release, "__closure__", None) or ():   # instrument_w_nvtx's wrapper around the cache
        if hasattr(cell.cell_contents, "cache_clear"):
            cell.cell_contents.cache_clear()
