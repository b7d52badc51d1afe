"""DanceGRPO for Flux with a LoRA adapter: `python -m dancegrpo.train_grpo_flux_lora ...`.

Upstream's fastvideo/train_grpo_flux_lora.py: the Flux trainer with --use_lora on by default
(dancegrpo.adapters.lora: r 128, alpha 256 on to_q, to_k, to_v, to_out.0). A trainer module of
its own with the same seams, so `python -m jagg_patch dancegrpo.train_grpo_flux_lora ...`
patches it like the others; the Qwen-Image trainer takes the same LoRA flags.
"""
from .args import build_parser as _build_parser, parse_args  # noqa: F401  (parse_args: run_trainer's)
from .entry import run_trainer, trainer_attributes

# FAMILY and the seams policy_update, select_train_steps, train_one_step, main: on first use.
__getattr__ = trainer_attributes(__name__, "dancegrpo.models.flux", "FluxFamily")


def build_parser():
    parser = _build_parser("flux", "DanceGRPO training of a LoRA adapter on Flux (upstream's "
                                   "train_grpo_flux_lora.py).")
    parser.set_defaults(use_lora=True)
    return parser


if __name__ == "__main__":
    run_trainer(__name__)
