"""The ONE list of what jagg_patch touches in dancegrpo.

Rebasing onto a new dancegrpo/ is a run of `check_seams` on every trainer: if a
seam moved or its signature changed, it fails here, naming the seam, instead of
silently training vanilla.
"""
import importlib
import inspect

# (module attribute, its expected parameter names). `policy_update` is replaced at
# run time, and `select_train_steps` too under the window grouping; `build_parser` and
# `main` are what the launcher calls; `train_one_step` and `FAMILY` (the model family
# class) are what the diagnostics drive.
SEAMS = (
    ("policy_update", ("batch",)),
    ("select_train_steps", ("num_samples", "num_transitions", "timestep_fraction", "generator")),
    ("build_parser", ()),
    ("main", ("args",)),
    ("train_one_step", ("ctx",)),
    ("FAMILY", ("args",)),
)
# Fields of the seam's argument / result that the JAGG update reads or fills.
UPDATE_BATCH_FIELDS = ("predict", "step_loss", "steps", "timesteps", "subset", "backward", "rollout_output",
                       "on_policy", "predict_batched")
UPDATE_STATS_FIELDS = ("loss", "backward_calls", "jagg_groups", "exact_groups", "forwards_reused")
TRAIN_SELECTION_FIELDS = ("steps", "num_train")
# The trainer keeps the rollout's model outputs (UpdateBatch.rollout_output) for a policy_update
# whose attribute says it reads them; dancegrpo's own policy_update declares False.
POLICY_UPDATE_ATTRIBUTES = ("uses_rollout_outputs",)


class SeamError(RuntimeError):
    """dancegrpo no longer offers a seam the patch relies on."""


def _param_names(obj):
    return tuple(p.name for p in inspect.signature(obj).parameters.values())


def _check_fields(cls, expected):
    names = set(getattr(cls, "__dataclass_fields__", {}))
    missing = [f for f in expected if f not in names]
    if missing:
        raise SeamError(f"dancegrpo.grpo.{cls.__name__} lacks fields {missing} that jagg_patch uses")


def check_seams(module):
    """Verify a trainer module (object or dotted name) still has every seam with the expected signature."""
    if isinstance(module, str):
        module = importlib.import_module(module)
    for name, params in SEAMS:
        obj = getattr(module, name, None)
        if obj is None or not callable(obj):
            raise SeamError(f"{module.__name__} has no callable {name!r}; jagg_patch needs it (see jagg_patch.seams)")
        found = _param_names(obj)
        if found != params:
            raise SeamError(f"{module.__name__}.{name} takes {found}, jagg_patch expects {params} "
                            "(see jagg_patch.seams)")
    from dancegrpo import grpo
    from dancegrpo.grpo import TrainSelection, UpdateBatch, UpdateStats
    for attribute in POLICY_UPDATE_ATTRIBUTES:
        if not hasattr(grpo.policy_update, attribute):
            raise SeamError(f"dancegrpo.grpo.policy_update lacks the attribute {attribute!r} that tells the "
                            "trainer what jagg_patch's update reads (see jagg_patch.seams)")
    _check_fields(UpdateBatch, UPDATE_BATCH_FIELDS)
    _check_fields(UpdateStats, UPDATE_STATS_FIELDS)
    _check_fields(TrainSelection, TRAIN_SELECTION_FIELDS)
    return module
