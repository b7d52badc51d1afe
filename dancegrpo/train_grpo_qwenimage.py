"""DanceGRPO for Qwen-Image: `python -m dancegrpo.train_grpo_qwenimage ...` (or under torchrun).

Upstream's fastvideo/train_grpo_qwenimage.py: the Qwen-Image family and its parser; the loop is
the shared one (dancegrpo.trainer), and `policy_update` / `select_train_steps` are this module's
own attributes, the seams jagg_patch replaces.
"""
from .args import build_parser as _build_parser, parse_args
from .models.qwenimage import QwenImageFamily
from .errors import exit_on_config_error
from .trainer import trainer_entry

FAMILY = QwenImageFamily
policy_update, select_train_steps, train_one_step, main = trainer_entry(__name__)


def build_parser():
    return _build_parser("qwenimage", "DanceGRPO training of Qwen-Image "
                                      "(QwenImageTransformer2DModel + AutoencoderKLQwenImage).")


if __name__ == "__main__":
    exit_on_config_error(main)(parse_args(build_parser()))
