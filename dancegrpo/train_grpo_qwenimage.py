"""DanceGRPO for Qwen-Image: `python -m dancegrpo.train_grpo_qwenimage ...` (or under torchrun).

Upstream's fastvideo/train_grpo_qwenimage.py: the Qwen-Image family and its parser; the loop is
the shared one (dancegrpo.trainer), and `policy_update` / `select_train_steps` are this module's
own attributes, the seams jagg_patch replaces.
"""
from .args import build_parser as _build_parser, parse_args  # noqa: F401  (parse_args: run_trainer's)
from .entry import run_trainer, trainer_attributes

# FAMILY and the seams policy_update, select_train_steps, train_one_step, main: on first use.
__getattr__ = trainer_attributes(__name__, "dancegrpo.models.qwenimage", "QwenImageFamily")


def build_parser():
    return _build_parser("qwenimage", "DanceGRPO training of Qwen-Image "
                                      "(QwenImageTransformer2DModel + AutoencoderKLQwenImage).")


if __name__ == "__main__":
    run_trainer(__name__)
