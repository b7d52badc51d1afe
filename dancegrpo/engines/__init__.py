"""How the ranks hold and step the model: one interface (engines.base.Engine), one module per
engine, registered here by name. The loop never asks which engine it has. An engine's module
(torch.distributed, DeepSpeed) is imported when the run builds it, not when the command line is
parsed (dancegrpo.utils.lazy)."""
import importlib

from ..utils.lazy import lazy_exports

# name -> (module, class) of the engine; a class may be registered directly (a test's, a user's)
ENGINES = {"fsdp": ("dancegrpo.engines.fsdp", "FSDPEngine"),
           "fsdp2": ("dancegrpo.engines.fsdp2", "FSDP2Engine"),
           "deepspeed": ("dancegrpo.engines.deepspeed", "DeepSpeedEngine")}

__getattr__ = lazy_exports(__name__, {"Engine": ".base", "build_optimizer": ".base", "FSDPEngine": ".fsdp",
                                      "FSDP2Engine": ".fsdp2", "plain_engine": ".fsdp", "DeepSpeedEngine": ".deepspeed"})


def engine_class(name):
    """The Engine subclass registered as `name`, imported on first use."""
    entry = ENGINES[name]
    if isinstance(entry, tuple):
        module, cls = entry
        entry = getattr(importlib.import_module(module), cls)
    return entry


def add_engine_args(parser):
    g = parser.add_argument_group("engine")
    g.add_argument("--engine", choices=tuple(ENGINES), default="fsdp",
                   help="How ranks share the model: FSDP1 as upstream (fsdp), torch's per-parameter FSDP2 "
                        "(fully_shard), or DeepSpeed ZeRO (--deepspeed_config).")
    g.add_argument("--deepspeed_config", default=None,
                   help="A DeepSpeed JSON config (ZeRO stage 1-3), e.g. configs/deepspeed/zero2.json or zero3.json.")


def validate_engine_args(args):
    engine_class(args.engine).validate_args(args)


def build_engine(args, family, raw, device, world_size):
    """The --engine around the loaded model `raw`, with its optimizer and scheduler."""
    return engine_class(args.engine).build(args, family, raw, device, world_size)


__all__ = ["ENGINES", "Engine", "FSDPEngine", "FSDP2Engine", "DeepSpeedEngine", "add_engine_args", "build_engine",
           "build_optimizer", "engine_class", "plain_engine", "validate_engine_args"]
