"""What the tests of scripts that parse absl flags and prepare their model with accelerate (the DanceGRPO
SD stand-in, the Flow-GRPO stand-in) share: absl's flags reset between in-process runs, and
accelerate's prepare wrapped to keep each real optimizer step's gradient."""
import contextlib

import torch


def fresh_absl_flags():
    """absl's flags as a new process has them: ml_collections registers a flag per config field overridden
    on the command line, which a second run in this process would register again."""
    from absl import flags
    for name in [n for n in list(flags.FLAGS) if n.startswith("config.")]:
        delattr(flags.FLAGS, name)
    flags.FLAGS.unparse_flags()


def flat_grad(params):
    return torch.cat([torch.zeros(p.numel(), dtype=p.dtype) if p.grad is None else p.grad.reshape(-1).clone()
                      for p in params])


@contextlib.contextmanager
def at_prepare(replace=None, before=None):
    """Accelerator.prepare wrapped (over whatever wraps it already): `before(model)` called on the model
    handed to it, the gradient of its trainable parameters kept at every real optimizer step,
    `replace(model)` returned for the prepared model. Yields (the gradients, the prepared models, the
    prepared models' forwards in grad mode: under DDP, each one a synced backward)."""
    from accelerate import Accelerator
    original, grads, models, grad_forwards = Accelerator.prepare, [], [], []

    def prepare(self, model, optimizer, *rest):
        if before is not None:
            before(model)
        params = [p for p in model.parameters() if p.requires_grad]
        model, wrapped, *rest = original(self, model, optimizer, *rest)
        wrapped.optimizer.register_step_pre_hook(lambda *a: grads.append(flat_grad(params)))
        model.register_forward_pre_hook(lambda *a: grad_forwards.append(1) if torch.is_grad_enabled() else None)
        models.append(model)
        return ((replace(model) if replace else model), wrapped, *rest)

    Accelerator.prepare = prepare
    try:
        yield grads, models, grad_forwards
    finally:
        Accelerator.prepare = original
