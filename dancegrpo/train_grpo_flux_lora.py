"""DanceGRPO for Flux with a LoRA adapter: `python -m dancegrpo.train_grpo_flux_lora ...`.

Upstream's fastvideo/train_grpo_flux_lora.py: the Flux trainer with --use_lora on by default
(dancegrpo.adapters.lora: r 128, alpha 256 on to_q, to_k, to_v, to_out.0). A trainer module of
its own with the same seams, so `python -m jagg_patch dancegrpo.train_grpo_flux_lora ...`
patches it like the others; the Qwen-Image trainer takes the same LoRA flags.
"""
from .args import build_parser as _build_parser, parse_args
from .models.flux import FluxFamily
from .errors import exit_on_config_error
from .trainer import trainer_entry

FAMILY = FluxFamily
policy_update, select_train_steps, train_one_step, main = trainer_entry(__name__)


def build_parser():
    parser = _build_parser("flux", "DanceGRPO training of a LoRA adapter on Flux (upstream's "
                                   "train_grpo_flux_lora.py).")
    parser.set_defaults(use_lora=True)
    return parser


if __name__ == "__main__":
    exit_on_config_error(main)(parse_args(build_parser()))
