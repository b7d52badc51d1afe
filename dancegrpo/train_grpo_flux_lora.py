"""DanceGRPO for Flux with a LoRA adapter: `python -m dancegrpo.train_grpo_flux_lora ...`.

Upstream's fastvideo/train_grpo_flux_lora.py as an entry point: the Flux trainer with --use_lora
on by default (dancegrpo.lora: r 128, alpha 256 on to_q, to_k, to_v, to_out.0). It is a trainer
module of its own, with the same seams as train_grpo_flux, so `python -m jagg_patch
dancegrpo.train_grpo_flux_lora ...` patches it like the others; the Qwen-Image trainer takes
the same LoRA flags.
"""
from . import trainer
from .args import build_parser as _build_parser, parse_args
from .grpo import policy_update, select_train_steps  # noqa: F401  (the patchable seams)
from .models.flux import FluxFamily
from .errors import exit_on_config_error
from .sde import flux_step, sd3_time_shift  # noqa: F401
from .trainer import grpo_one_step, run_sample_step, sample_reference_model  # noqa: F401

FAMILY = FluxFamily


def build_parser():
    parser = _build_parser("flux", "DanceGRPO training of a LoRA adapter on Flux (upstream's "
                                   "train_grpo_flux_lora.py).")
    parser.set_defaults(use_lora=True)
    return parser


def train_one_step(ctx):
    return trainer.train_one_step(ctx, policy_update, select_train_steps)


def main(args):
    # `train_one_step` is passed through the module namespace on purpose: see train_grpo_flux.
    return trainer.run(args, FAMILY(args), lambda ctx: train_one_step(ctx))


if __name__ == "__main__":
    exit_on_config_error(main)(parse_args(build_parser()))
