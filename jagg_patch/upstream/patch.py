"""apply / revert: replace an upstream trainer module's train_one_step by the restated one
(jagg_patch.upstream.step) with jagg_patch's policy update, after checking the fingerprint."""
import inspect
import json
import os
import uuid

from dancegrpo.algo.grpo import select_train_steps
from dancegrpo.utils.communications import launch_rank, print_on_rank0

from ..config import as_config
from ..update import make_policy_update, make_window_selection
from .families import FAMILIES
from .fingerprint import check_upstream
from .step import train_step

_ORIGINALS = {}   # module name -> upstream's own train_one_step, while patched


def _write_metrics_line(args, record):
    """<output_dir>/jagg_metrics.jsonl, one line per step on rank 0; appended (lines of other runs
    in the folder are kept, told apart by run_id)."""
    output_dir = getattr(args, "output_dir", None)
    if not output_dir or launch_rank() != 0:
        return
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, "jagg_metrics.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")


def make_train_one_step(module, trainer, update, select, original):
    """A function with upstream's train_one_step parameters that runs the restated step of the
    checked trainer file (`trainer`, a fingerprint.Trainer)."""
    signature, run_id = inspect.signature(original), uuid.uuid4().hex[:12]
    release = trainer.release_text()

    def train_one_step(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        if train_one_step.calls == 0:
            note = FAMILIES[trainer.family].clip_note(bound.arguments["transformer"])
            if note:
                print_on_rank0(note)
        result, stats = train_step(module, trainer, update, select, bound.arguments, step=train_one_step.calls + 1)
        train_one_step.calls += 1
        train_one_step.last_stats = stats
        _write_metrics_line(bound.arguments["args"], {"step": train_one_step.calls, "run_id": run_id,
                                                      "family": trainer.family, "release": release,
                                                      **update.jagg_config.as_dict(), **stats})
        return result

    train_one_step.__signature__ = signature
    train_one_step.__name__ = original.__name__
    train_one_step.calls, train_one_step.last_stats = 0, None
    train_one_step.jagg_config, train_one_step.jagg_family = update.jagg_config, trainer.family
    train_one_step.jagg_trainer = trainer
    return train_one_step


def apply(module, config=None, *, allow_upstream_changes=False, releases=None, **settings):
    """Replace module.train_one_step (upstream's own, from load_trainer or an import) by JAGG's, with
    a JaggConfig (or its settings by name: window=4, jagg_frac=0.6, ...). mode "exact" reproduces
    upstream's step; grouping "window" is the authors' (it draws windows, not upstream's
    transitions); upstream's micro-batch is one sample, so the monitor measures each rank's first
    sample of the step. releases: the known releases of train_one_step (default
    jagg_patch.seams.UPSTREAM_RELEASES). Applying again only changes the configuration. Returns the
    family; the replacement's `jagg_trainer` says what the checks found (its known release)."""
    config = as_config(config, **settings)
    original = _ORIGINALS.get(module.__name__, getattr(module, "train_one_step", None))
    if original is not None:
        module.train_one_step = original   # the fingerprint is of upstream's own function
    trainer = check_upstream(module, allow_upstream_changes, releases)
    update = make_policy_update(config)
    select = make_window_selection(config.window) if config.grouping == "window" else select_train_steps
    _ORIGINALS[module.__name__] = original
    module.train_one_step = make_train_one_step(module, trainer, update, select, original)
    return trainer.family


def revert(module):
    """Put upstream's own train_one_step back."""
    original = _ORIGINALS.pop(module.__name__, None)
    if original is not None:
        module.train_one_step = original


def is_applied(module):
    return module.__name__ in _ORIGINALS
