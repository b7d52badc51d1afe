"""DanceGRPO for Qwen-Image: `python -m dancegrpo.train_grpo_qwenimage ...` (or under torchrun).

Names follow upstream's fastvideo/train_grpo_qwenimage.py. The loop is the
shared one (`dancegrpo.trainer`); only the model family differs. As in the Flux
trainer, `policy_update` and `select_train_steps` are the seams that
`jagg_patch` replaces and `train_one_step` looks them up in this module at call
time, so patching this module's attributes is enough.
"""
from . import trainer
from .args import build_parser as _build_parser, parse_args
from .grpo import policy_update, select_train_steps  # noqa: F401  (the patchable seams)
from .models.base import pack_latents, unpack_latents  # noqa: F401
from .models.qwenimage import QwenImageFamily
from .sde import flux_step, sd3_time_shift  # noqa: F401
from .distributed import gather_tensor  # noqa: F401
from .errors import exit_on_config_error
from .trainer import grpo_one_step, run_sample_step, sample_reference_model  # noqa: F401

FAMILY = QwenImageFamily


def build_parser():
    return _build_parser("qwenimage", "DanceGRPO training of Qwen-Image "
                                      "(QwenImageTransformer2DModel + AutoencoderKLQwenImage).")


def train_one_step(ctx):
    return trainer.train_one_step(ctx, policy_update, select_train_steps)


def main(args):
    # `train_one_step` is passed through the module namespace on purpose: see the module docstring.
    return trainer.run(args, FAMILY(args), lambda ctx: train_one_step(ctx))


if __name__ == "__main__":
    exit_on_config_error(main)(parse_args(build_parser()))
