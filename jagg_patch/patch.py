"""apply / revert of dancegrpo's policy-update seams (as Liger-Kernel's monkey_patch): the JAGG
update itself is jagg_patch.update's.

Each trainer's `train_one_step` reads its module-globals `policy_update` and
`select_train_steps` at call time, so swapping those attributes switches a run to
JAGG and back. The trained grouping replaces only `policy_update`; the window
grouping (the authors' code) also replaces the choice of trained transitions.
`apply_deferred` leaves the update as it is and wraps `train_one_step` instead, so that the
trainer's own update calls the transformer through jagg_patch.deferred's proxy (under the window
grouping it replaces the choice of trained transitions as well).
"""
import importlib

from .config import as_config
from .seams import check_seams
from .update import seam_replacements

REPLACED = ("policy_update", "select_train_steps")
WRAPPED = "train_one_step"   # by apply_deferred
_ORIGINALS = {}  # (module name, seam) -> the original object, while patched


def _trainer_modules(trainer_module):
    if trainer_module is None:
        import dancegrpo
        return [importlib.import_module(name) for name in dancegrpo.TRAINERS]
    if isinstance(trainer_module, str):
        return [importlib.import_module(trainer_module)]
    if isinstance(trainer_module, (list, tuple)):
        return [m for item in trainer_module for m in _trainer_modules(item)]
    return [trainer_module]


def apply_jagg(config=None, *, trainer_module=None, **settings):
    """Patch the update seams of one trainer module (object or name; a list of them) or, by default,
    of every trainer in dancegrpo.TRAINERS, with a JaggConfig (or its settings by name: window=4, ...).
    Applying again only changes the configuration.

    The defaults are the paper's grouping, alpha and joint backward, plus on-policy rollout reuse
    (exact: the same gradient). The command line's --jagg_backward defaults to auto instead (the
    cheapest form for the run's world size: see jagg_patch.core.resolve_backward)."""
    replacements = seam_replacements(as_config(config, **settings))
    modules = _trainer_modules(trainer_module)
    for module in modules:
        check_seams(module)
    for module in modules:
        for seam in REPLACED:
            original = _ORIGINALS.setdefault((module.__name__, seam), getattr(module, seam))
            setattr(module, seam, replacements.get(seam, original))
        _restore(module, WRAPPED)
    return modules


def apply_deferred(config=None, *, trainer_module=None, **settings):
    """Run the trainer's own (vanilla) update with its transformer behind jagg_patch.deferred's proxy:
    its train_one_step seam is wrapped (jagg_patch.trainer_deferred), its policy_update stays the
    original (and select_train_steps too, but under the window grouping: the authors' windows). Same
    arguments as apply_jagg; revert_jagg undoes it."""
    from .deferred.proxy import check_config
    from .trainer_deferred import deferred_train_one_step
    from .update import make_window_selection
    config = as_config(config, **settings)
    # the window grouping: the trainer draws whole windows (its select_train_steps seam); S, which the
    # window must divide, is the trainer's, checked when the proxy is made (trainer_deferred.install)
    check_config(config, transitions=config.window if config.grouping == "window" else None)
    modules = _trainer_modules(trainer_module)
    for module in modules:
        check_seams(module)
    for module in modules:
        for seam in REPLACED:
            _restore(module, seam)
        if config.grouping == "window":
            _ORIGINALS[(module.__name__, "select_train_steps")] = module.select_train_steps
            module.select_train_steps = make_window_selection(config.window)
        original = _ORIGINALS.setdefault((module.__name__, WRAPPED), getattr(module, WRAPPED))
        setattr(module, WRAPPED, deferred_train_one_step(original, config))
    return modules


def _restore(module, seam):
    original = _ORIGINALS.pop((module.__name__, seam), None)
    if original is not None:
        setattr(module, seam, original)


def revert_jagg(trainer_module=None):
    """Put the original seam objects back (default: every module patched so far)."""
    names = None if trainer_module is None else {m.__name__ for m in _trainer_modules(trainer_module)}
    for name, seam in list(_ORIGINALS):
        if names is None or name in names:
            setattr(importlib.import_module(name), seam, _ORIGINALS.pop((name, seam)))


def is_patched(trainer_module):
    name = _trainer_modules(trainer_module)[0].__name__
    return any(key[0] == name for key in _ORIGINALS)


__all__ = ["apply_jagg", "apply_deferred", "revert_jagg", "is_patched"]
