"""How the ranks hold and step the model: one interface (engines.base.Engine), one module per
engine, registered here. The loop never asks which engine it has."""
from .base import Engine, build_optimizer
from .deepspeed import DeepSpeedEngine
from .fsdp import FSDPEngine, plain_engine

ENGINES = {engine.name: engine for engine in (FSDPEngine, DeepSpeedEngine)}


def add_engine_args(parser):
    g = parser.add_argument_group("engine")
    g.add_argument("--engine", choices=tuple(ENGINES), default="fsdp",
                   help="How ranks share the model: FSDP1 as upstream, or DeepSpeed ZeRO (--deepspeed_config).")
    g.add_argument("--deepspeed_config", default=None,
                   help="A DeepSpeed JSON config (ZeRO stage 1-3), e.g. configs/deepspeed/zero2.json or zero3.json.")


def validate_engine_args(args):
    ENGINES[args.engine].validate_args(args)


def build_engine(args, family, raw, device, world_size):
    """The --engine around the loaded model `raw`, with its optimizer and scheduler."""
    return ENGINES[args.engine].build(args, family, raw, device, world_size)


__all__ = ["ENGINES", "Engine", "FSDPEngine", "DeepSpeedEngine", "add_engine_args", "build_engine",
           "build_optimizer", "plain_engine", "validate_engine_args"]
