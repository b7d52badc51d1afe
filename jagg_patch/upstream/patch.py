"""apply / revert: replace an upstream trainer module's train_one_step by the restated one
(jagg_patch.upstream.step) with jagg_patch's policy update, after checking the fingerprint."""
import inspect
import json
import os
import uuid

from dancegrpo.algo.grpo import select_train_steps

from ..core import validate_jagg_config
from ..patch import make_policy_update, make_window_selection
from .families import FAMILIES
from .fingerprint import check_upstream
from .step import train_step

_ORIGINALS = {}   # module name -> upstream's own train_one_step, while patched


def _print_on_rank0(message):
    if int(os.environ.get("RANK", "0")) == 0:
        print(message, flush=True)


def _write_metrics_line(args, record):
    """<output_dir>/jagg_metrics.jsonl, one line per step on rank 0; appended (lines of other runs
    in the folder are kept, told apart by run_id)."""
    output_dir = getattr(args, "output_dir", None)
    if not output_dir or int(os.environ.get("RANK", "0")) != 0:
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
                _print_on_rank0(note)
        result, stats = train_step(module, trainer, update, select, bound.arguments, step=train_one_step.calls + 1)
        train_one_step.calls += 1
        train_one_step.last_stats = stats
        _write_metrics_line(bound.arguments["args"], {"step": train_one_step.calls, "run_id": run_id,
                                                      "family": trainer.family, "release": release,
                                                      **update.jagg_config, **stats})
        return result

    train_one_step.__signature__ = signature
    train_one_step.__name__ = original.__name__
    train_one_step.calls, train_one_step.last_stats = 0, None
    train_one_step.jagg_config, train_one_step.jagg_family = update.jagg_config, trainer.family
    train_one_step.jagg_trainer = trainer
    return train_one_step


def apply(module, window=4, jagg_frac=0.6, mode="jagg", alpha="timestep", backward="joint", reuse="on_policy",
          grouping="trained", allow_upstream_changes=False, releases=None, monitor_every=0, monitor_samples=2,
          min_cos=0.8):
    """Replace module.train_one_step (upstream's own, from load_trainer or an import) by JAGG's.
    mode "exact" reproduces upstream's step; grouping "window" is the authors' (it draws windows,
    not upstream's transitions). monitor_every / monitor_samples / min_cos and jagg_frac "auto":
    jagg_patch.make_policy_update's; upstream's micro-batch is one sample, so the monitor measures
    each rank's first sample of the step. releases: the known releases of train_one_step (default
    jagg_patch.seams.UPSTREAM_RELEASES). Applying again only changes the configuration. Returns the
    family; the replacement's `jagg_trainer` says what the checks found (its known release)."""
    validate_jagg_config(window, jagg_frac, mode, alpha, backward, grouping, reuse)
    original = _ORIGINALS.get(module.__name__, getattr(module, "train_one_step", None))
    if original is not None:
        module.train_one_step = original   # the fingerprint is of upstream's own function
    trainer = check_upstream(module, allow_upstream_changes, releases)
    update = make_policy_update(window, jagg_frac, mode, alpha, backward, grouping, reuse, monitor_every,
                                monitor_samples, min_cos)
    select = make_window_selection(window) if grouping == "window" else select_train_steps
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
