"""apply / revert: replace an upstream trainer module's train_one_step by the restated one
(jagg_patch.upstream.step) with jagg_patch's policy update, after checking the fingerprint."""
import inspect
import json
import os
import uuid

from dancegrpo.algo.grpo import select_train_steps
from dancegrpo.errors import DiskFullError, is_disk_full
from dancegrpo.utils.communications import all_reduce_max
from dancegrpo.utils.launch import launch_rank, print_on_rank0
from dancegrpo.utils.metrics import append_line, drop_torn_tail

from ..config import as_config
from ..update import make_policy_update, make_window_selection
from .families import FAMILIES
from .fingerprint import check_upstream
from .step import train_step

_ORIGINALS = {}   # module name -> upstream's own train_one_step, while patched


METRICS_FILE = "jagg_metrics.jsonl"


def _write_metrics_line(args, record, first):
    """<output_dir>/jagg_metrics.jsonl, one line per step on rank 0; appended (lines of other runs
    in the folder are kept, told apart by run_id), a torn line left by an earlier run dropped first.
    Returns the OSError of a full disk (the line then not written at all), else None."""
    output_dir = getattr(args, "output_dir", None)
    if not output_dir or launch_rank() != 0:
        return None
    path = os.path.join(output_dir, METRICS_FILE)
    try:
        os.makedirs(output_dir, exist_ok=True)
        if first:
            drop_torn_tail(path)
        append_line(path, json.dumps(record))
    except OSError as e:
        if not is_disk_full(e):
            raise
        return e
    return None


def _stop_if_disk_full(error, args, step, device):
    """Every rank agrees whether rank 0 found the disk full (so none waits in a collective for a rank
    that stopped), then all stop with DiskFullError (exit 3)."""
    if not all_reduce_max(float(error is not None), device):
        return
    why = getattr(error, "strerror", None) or "No space left on device"
    raise DiskFullError(f"no space left to write step {step}'s line of {METRICS_FILE} in {args.output_dir!r} "
                        f"({why}); the file keeps the steps before it, nothing half-written; upstream's "
                        "checkpoints written so far are untouched. Free space, then start the run again")


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
        run_args = bound.arguments["args"]
        error = _write_metrics_line(run_args, {"step": train_one_step.calls, "run_id": run_id,
                                               "family": trainer.family, "release": release,
                                               **update.jagg_config.as_dict(), **stats},
                                    first=train_one_step.calls == 1)
        _stop_if_disk_full(error, run_args, train_one_step.calls, bound.arguments["device"])
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
