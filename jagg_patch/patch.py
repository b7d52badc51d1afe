"""Replacing dancegrpo's policy-update seam with the JAGG update (Liger-Kernel style).

Each trainer's `train_one_step` reads its module-global `policy_update` at call
time, so swapping that attribute switches a run to JAGG and back.
"""
import importlib

from dancegrpo.grpo import UpdateStats

from .core import jagg_group_backward, plan_groups, validate_jagg_config
from .seams import check_seams

SEAM = "policy_update"
_ORIGINALS = {}  # module name -> the original seam object, while patched


def make_policy_update(window=4, jagg_frac=0.6, mode="jagg"):
    """The JAGG replacement for dancegrpo.grpo.policy_update, configured."""
    validate_jagg_config(window, jagg_frac, mode)

    def policy_update(batch):
        # Vanilla trains the transitions in random order; JAGG needs denoising order.
        # The set of transitions (and so the gradient of the exact path) is unchanged.
        ks = batch.steps.sort(dim=1).values
        timesteps = batch.timesteps.to(ks.device)
        m = ks.shape[0]
        stats = UpdateStats()
        for group in plan_groups(range(ks.shape[1]), window, jagg_frac):
            cols = ks[:, list(group.members)]                      # [m, W]
            group_mode = mode if group.jagg else "exact"
            result = jagg_group_backward(lambda j: batch.predict(cols[:, j]),
                                         lambda j, v: batch.step_loss(cols[:, j], v),
                                         timesteps[cols].T, group_mode)  # t: [W, m]
            stats.loss += result.loss
            stats.backward_calls += result.backward_calls
            # Counted per sample, like transformer_backwards (2 per JAGG group).
            if group_mode == "exact":
                stats.exact_groups += m
            else:
                stats.jagg_groups += m
        return stats

    policy_update.jagg_config = dict(window=window, jagg_frac=jagg_frac, mode=mode)
    return policy_update


def _trainer_modules(trainer_module):
    if trainer_module is None:
        import dancegrpo
        return [importlib.import_module(name) for name in dancegrpo.TRAINERS]
    if isinstance(trainer_module, str):
        return [importlib.import_module(trainer_module)]
    if isinstance(trainer_module, (list, tuple)):
        return [m for item in trainer_module for m in _trainer_modules(item)]
    return [trainer_module]


def apply_jagg(trainer_module=None, *, window=4, jagg_frac=0.6, mode="jagg"):
    """Patch the update seam of one trainer module (object or name) or, by default, of every
    trainer in dancegrpo.TRAINERS. Applying again only changes the configuration."""
    update = make_policy_update(window, jagg_frac, mode)
    modules = _trainer_modules(trainer_module)
    for module in modules:
        check_seams(module)
    for module in modules:
        _ORIGINALS.setdefault(module.__name__, getattr(module, SEAM))
        setattr(module, SEAM, update)
    return modules


def revert_jagg(trainer_module=None):
    """Put the original seam objects back (default: every module patched so far)."""
    names = list(_ORIGINALS) if trainer_module is None else [m.__name__ for m in _trainer_modules(trainer_module)]
    for name in names:
        if name in _ORIGINALS:
            setattr(importlib.import_module(name), SEAM, _ORIGINALS.pop(name))


def is_patched(trainer_module):
    return _trainer_modules(trainer_module)[0].__name__ in _ORIGINALS


__all__ = ["apply_jagg", "revert_jagg", "make_policy_update", "is_patched"]
