"""DanceGRPO for Flux: `python -m dancegrpo.train_grpo_flux ...` (or under torchrun).

Upstream's fastvideo/train_grpo_flux.py: the Flux family and its parser; the loop is the shared
one (dancegrpo.trainer), and `policy_update` / `select_train_steps` are this module's own
attributes, the seams jagg_patch replaces.
"""
from .args import build_parser as _build_parser, parse_args
from .models.flux import FluxFamily
from .errors import exit_on_config_error
from .trainer import trainer_entry

FAMILY = FluxFamily
policy_update, select_train_steps, train_one_step, main = trainer_entry(__name__)


def build_parser():
    return _build_parser("flux", "DanceGRPO training of Flux (FluxTransformer2DModel + AutoencoderKL).")


if __name__ == "__main__":
    exit_on_config_error(main)(parse_args(build_parser()))
