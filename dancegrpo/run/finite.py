"""Never train on NaN: the trainer's checks on every step's rewards, advantages, loss and
gradient norm, made before the optimizer step so the last checkpoint stays clean.

Under torchrun every rank takes the same decision (a max over ranks of a 'bad' flag), so
no rank steps while another stops.
"""
import math

import torch

from ..utils.communications import all_reduce_max
from ..errors import NonFiniteError

HINTS = {
    "reward": "check the reward models' weights and the --reward weights",
    "advantage": "check the rewards (an inf reward gives NaN advantages)",
    "rollout log-prob": "the policy's output is NaN/inf: the weights diverged; resume from an earlier "
                        "checkpoint with a lower --learning_rate",
    "loss": "lower --learning_rate or --clip_range, or resume from an earlier checkpoint",
    "grad norm": "lower --learning_rate or --max_grad_norm, or resume from an earlier checkpoint",
    "weights": "the update diverged: lower --learning_rate and resume from an earlier checkpoint",
}


def _is_finite(value):
    if torch.is_tensor(value):
        return bool(torch.isfinite(value).all())
    return math.isfinite(float(value))


def require_finite(quantity, value, step, device, where=""):
    """Stop with NonFiniteError when `value` (a float or tensor) is NaN/inf on any rank."""
    bad = all_reduce_max(0.0 if _is_finite(value) else 1.0, device)
    if bad:
        shown = f" = {float(value)}" if not torch.is_tensor(value) else ""
        raise NonFiniteError(
            f"{quantity}{shown} is not finite at step {step}{where}. The run stopped before applying it: no "
            f"optimizer step or checkpoint followed, so the last checkpoint is clean. What to try: "
            f"{HINTS.get(quantity, 'see the logs')}.")
