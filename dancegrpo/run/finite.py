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


def require_finite(quantity, value, step, device, where="", hint=None):
    """Stop with NonFiniteError when `value` (a float or tensor) is NaN/inf on any rank. `hint`:
    what to try, instead of the quantity's usual advice; a callable is asked only then (on every
    rank, so it may be collective)."""
    bad = all_reduce_max(0.0 if _is_finite(value) else 1.0, device)
    if bad:
        shown = f" = {float(value)}" if not torch.is_tensor(value) else ""
        advice = (hint() if callable(hint) else hint) or HINTS.get(quantity, "see the logs")
        raise NonFiniteError(
            f"{quantity}{shown} is not finite at step {step}{where}. The run stopped before applying it: no "
            f"optimizer step or checkpoint followed, so the last checkpoint is clean. What to try: {advice}.")


def nonfinite_parameters(model):
    """Names of the parameters holding NaN/inf."""
    return [name for name, p in model.named_parameters() if not bool(torch.isfinite(p).all())]


def damaged_weights_hint(model, device):
    """For a NaN/inf policy output: the run never steps on a NaN loss or gradient, so weights that
    hold NaN/inf came that way from the files it loaded (the model folder or the checkpoint it
    resumed), a damaged file rather than a diverged run. None (the usual advice) when they are
    finite. Collective: every rank checks its own part."""
    bad = nonfinite_parameters(model)
    if not all_reduce_max(float(len(bad)), device):
        return None
    example = f", e.g. {bad[0]}" if bad else ""
    return (f"the loaded weights hold NaN/inf ({len(bad)} tensors on this rank{example}): the model files "
            "(--pretrained_model_name_or_path, or the checkpoint resumed from) are damaged; download the weights "
            "again, or resume from another checkpoint")
