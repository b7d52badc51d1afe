"""apply / revert: replace an upstream trainer module's train_one_step, after checking the fingerprint,
by the restated one (jagg_patch.upstream.step) with jagg_patch's policy update, or by the file's own
train_one_step run as it is (jagg_patch.upstream.own_step): with the transformer behind the deferred
proxy for --jagg_deferred and for any train_one_step that is no release the restated step is written
for, untouched for --jagg_mode exact."""
import inspect
import os
import uuid

from dancegrpo.algo.grpo import select_train_steps
from dancegrpo.utils.launch import print_on_rank0

from ..config import as_config
from ..deferred.proxy import check_config
from ..metrics_file import write_step_line
from ..update import make_policy_update, make_window_selection
from .families import FAMILIES
from .fingerprint import UpstreamUnsupported, check_upstream
from .own_step import own_train_one_step
from .step import train_step

_ORIGINALS = {}   # module name -> upstream's own train_one_step, while patched


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
        write_step_line(bound.arguments["args"], {"step": train_one_step.calls, "run_id": run_id,
                                                  "family": trainer.family, "release": release, "update": "restated",
                                                  **update.jagg_config.as_dict(), **stats},
                        train_one_step.calls, bound.arguments["device"])
        return result

    train_one_step.__signature__ = signature
    train_one_step.__name__ = original.__name__
    train_one_step.calls, train_one_step.last_stats = 0, None
    train_one_step.jagg_config, train_one_step.jagg_family = update.jagg_config, trainer.family
    train_one_step.jagg_trainer, train_one_step.jagg_update = trainer, "restated"
    return train_one_step


def apply(module, config=None, *, allow_upstream_changes=False, releases=None, deferred=False, restated=False,
          **settings):
    """Replace module.train_one_step (upstream's own, from load_trainer or an import) with a JaggConfig
    (or its settings by name: window=4, jagg_frac=0.6, ...): the restated step for a known release;
    the file's own step with its backward deferred for `deferred` or an unknown source (said in one
    line); the file's own step untouched for mode "exact". grouping "window" is the authors' (the
    restated step draws windows, not upstream's transitions); upstream's micro-batch is one sample, so
    the monitor measures each rank's first sample of the step. releases: the known releases of
    train_one_step (default jagg_patch.seams.UPSTREAM_RELEASES). Applying again only changes the
    configuration. restated: the restated step whatever the release and mode (a check of the
    restatement: in mode "exact" it is upstream's own step, gradient for gradient). Returns the family
    (None where no family's); the replacement's `jagg_trainer` says what the checks found, its
    `jagg_update` what runs ("restated", "deferred", "own step")."""
    config = as_config(config, **settings)
    original = _ORIGINALS.get(module.__name__, getattr(module, "train_one_step", None))
    if original is not None:
        module.train_one_step = original   # the fingerprint is of upstream's own function
    trainer = check_upstream(module, allow_upstream_changes, releases)
    if restated and trainer.family is None:
        raise UpstreamUnsupported(f"{os.path.basename(trainer.file)}: train_one_step is {trainer.unknown}: the "
                                  "restated step is written for none of its kind")
    if not restated and (config.mode == "exact" or deferred or trainer.unknown):
        if config.mode != "exact":
            check_config(config)
            if trainer.unknown and not deferred and module.__name__ not in _ORIGINALS:   # said once, not again
                print_on_rank0(f"notice: {os.path.basename(trainer.file)}: train_one_step is {trainer.unknown}: it "
                               "runs as it is, its own code, with the backward deferred (jagg_patch.deferred, "
                               "docs/deferred.md), never the restated step")
        replacement = own_train_one_step(trainer, config, original, deferred=config.mode != "exact")
    else:
        update = make_policy_update(config)
        select = make_window_selection(config.window) if config.grouping == "window" else select_train_steps
        replacement = make_train_one_step(module, trainer, update, select, original)
    _ORIGINALS[module.__name__] = original
    module.train_one_step = replacement
    return trainer.family


def revert(module):
    """Put upstream's own train_one_step back."""
    original = _ORIGINALS.pop(module.__name__, None)
    if original is not None:
        module.train_one_step = original


def is_applied(module):
    return module.__name__ in _ORIGINALS
