"""What a run was configured with, saved in each checkpoint (run_config.json) so that a
resume can reproduce the unbroken run or say why it will not.

Every flag counts except those that only say where files go, how long to run, or how to log
(NEUTRAL): a different learning rate, reward, S, batching or JAGG setting gives a run that
differs from the one the checkpoint belongs to.
"""
import json
import os

CONFIG_NAME = "run_config.json"   # in each checkpoint folder

NEUTRAL = frozenset({
    "output_dir", "resume_from_checkpoint", "max_train_steps", "checkpointing_steps", "checkpoints_total_limit",
    "report_to", "logging_dir", "dataloader_num_workers", "cache_dir", "preset", "allow_config_change",
    "overwrite_output_dir", "explicit_flags", "typed_flags", "resume_from_lora_checkpoint", "lora_save_merged",
})
MISSING = "(not set)"


WORLD_SIZE = "world_size"   # not a flag: the number of ranks that ran it


def read_run_config(folder):
    """The run_config.json a checkpoint folder holds, or None (a checkpoint from before it existed)."""
    path = os.path.join(folder, CONFIG_NAME)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def snapshot(args, seed, world_size):
    """JSON-safe {flag: value} of the run, with the seed actually used and the rank count."""
    config = json.loads(json.dumps(vars(args), default=str))
    config["seed"] = seed
    config[WORLD_SIZE] = world_size
    return config


def config_id(config):
    """A short digest of the flags that change a run (and the rank count): equal over the segments of
    a resumed run, different where --allow_config_change let a flag change."""
    import hashlib
    kept = {k: v for k, v in config.items() if k not in NEUTRAL}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:12]


def world_size_change(saved, current):
    """(saved, current) rank counts when they differ, else None (a checkpoint that predates the
    record is taken as written by the current count)."""
    before, now = saved.get(WORLD_SIZE, current[WORLD_SIZE]), current[WORLD_SIZE]
    return (before, now) if before != now else None


def differences(saved, current):
    """[(flag, saved value, current value)] over the flags that change the run."""
    keys = (set(saved) | set(current)) - NEUTRAL - {WORLD_SIZE}
    return [(k, saved.get(k, MISSING), current.get(k, MISSING)) for k in sorted(keys)
            if saved.get(k, MISSING) != current.get(k, MISSING)]


def _said(value):
    """A flag's value as a user typed it; None is a flag left at its default (e.g. --mixed_precision's
    float32 on CPU), which a user never types as None."""
    return "not given (its default)" if value is None else repr(value)


def describe_differences(diffs):
    return "; ".join(f"--{k}: {_said(old)} in the checkpoint, {_said(new)} now" for k, old, new in diffs)
