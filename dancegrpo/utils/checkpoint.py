"""Checkpoints: a diffusers drop-in transformer folder plus the training state.

    checkpoint-{step}-{epoch}/
        config.json, diffusion_pytorch_model.safetensors   (load with <Model>.from_pretrained(dir);
                                                            the full model, written by rank 0)
        training_state.pt                                  (scheduler, step, seed: for resume)
        optimizer/.metadata, optimizer/__<rank>_0.distcp   (AdamW state, one shard per rank: optimizer_shards)
        run_config.json                                    (the flags of the run, for resume checks: a JSON
                                                            file the caller names, dancegrpo.run.run_config)
        ema/config.json, ema/diffusion_pytorch_model.safetensors   (with --use_ema)
        MANIFEST.json                                      (every file's size; written last)

Written into `<name>.tmp` and renamed into place after the step's update, so a crash or a full
disk never leaves a half-written checkpoint under the final name; a checkpoint saved again
under the same name replaces the old one only once the new one is complete. Files get the
permissions of the user's umask (safetensors alone writes 0600).
"""
import glob
import json
import os
import re
import shutil
import zipfile

import torch
from safetensors import safe_open
from torch.distributed.checkpoint.api import CheckpointException
from safetensors.torch import load_file, save_file

from . import optimizer_shards
from .communications import all_reduce_max, barrier
from ..errors import ConfigError, DiskFullError, MissingFileError, RunHalted, is_disk_full

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
LORA_WEIGHTS_NAME = "pytorch_lora_weights.safetensors"  # diffusers' name for an adapter (dancegrpo.adapters.lora)
WEIGHT_FILES = (WEIGHTS_NAME, LORA_WEIGHTS_NAME)
STATE_NAME = "training_state.pt"
OPTIMIZER_DIR = "optimizer"
MANIFEST_NAME = "MANIFEST.json"
_NAME = re.compile(r"checkpoint-(\d+)-(\d+)")


def write_transformer_folder(folder, state_dict, config):
    os.makedirs(folder, exist_ok=True)
    save_file(state_dict, os.path.join(folder, WEIGHTS_NAME), metadata={"format": "pt"})
    config = {k: v for k, v in dict(config).items() if k != "dtype"}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2, default=list)


class FullWeights:
    """A full fine-tune's checkpoint weights: a drop-in diffusers transformer folder. (A LoRA run
    uses dancegrpo.adapters.lora.LoraWeights, with the same members.)"""
    trainable_only = False

    @staticmethod
    def write(folder, state, model_config):
        write_transformer_folder(folder, state, model_config)

    @staticmethod
    def read_state(folder):
        return load_folder_state(folder)

    @staticmethod
    def load_into(raw_model, folder):
        load_weights_into(raw_model, folder)


def weights_file(folder):
    """The weights file a checkpoint folder holds (full or LoRA), or None."""
    return next((n for n in WEIGHT_FILES if os.path.isfile(os.path.join(folder, n))), None)


def checkpoint_dir(output_dir, step, epoch=0):
    return os.path.join(output_dir, f"checkpoint-{step}-{epoch}")


def _files(folder):
    return sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs)


def _finish_folder(folder):
    """Umask permissions on everything, then the manifest of sizes (last: its presence means complete)."""
    umask = os.umask(0)
    os.umask(umask)
    for d, _, fs in os.walk(folder):
        os.chmod(d, 0o777 & ~umask)
        for f in fs:
            os.chmod(os.path.join(d, f), 0o666 & ~umask)
    sizes = {f: os.path.getsize(os.path.join(folder, f)) for f in _files(folder)}
    with open(os.path.join(folder, MANIFEST_NAME), "w") as f:
        json.dump(sizes, f, indent=1)
    os.chmod(os.path.join(folder, MANIFEST_NAME), 0o666 & ~umask)


def _write_checkpoint(tmp, final, weights, config, ema_state, state, json_files, weights_format):
    """Rank 0's files into `tmp` (which already holds every rank's optimizer shard), then the rename."""
    weights_format.write(tmp, weights, config)
    if ema_state is not None:
        weights_format.write(os.path.join(tmp, "ema"), ema_state, config)
    torch.save(state, os.path.join(tmp, STATE_NAME))
    for name, value in (json_files or {}).items():
        with open(os.path.join(tmp, name), "w") as f:
            json.dump(value, f, indent=1, sort_keys=True)
    _finish_folder(tmp)
    old = final + ".old"
    if os.path.isdir(final):
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def _causes(error):
    """`error`, what it was raised from, and the per-rank failures a DCP CheckpointException wraps."""
    seen, todo = [], [error]
    while todo:
        e = todo.pop()
        if e is None or any(e is s for s in seen):
            continue
        seen.append(e)
        failures = getattr(e, "failures", {}).values()   # rank -> (exception, its traceback)
        todo += [e.__cause__, e.__context__, *(f[0] if isinstance(f, tuple) else f for f in failures)]
    return seen


def _disk_full_cause(error):
    """The ENOSPC / EDQUOT OSError in `error`, else None (True when only its text says so)."""
    for e in _causes(error):
        if is_disk_full(e):
            return e
    return "No space left on device" in str(error) or "Disk quota exceeded" in str(error) or None


FULL_DISK_ADVICE = ("Free space, or keep fewer checkpoints with --checkpoints_total_limit N (older ones are deleted "
                    "before the next is written; the newest whole one stays until then, so the disk needs room "
                    "for max(N, 2)), then resume with --resume_from_checkpoint latest.")


def previous_kept(output_dir):
    """What a full disk leaves to resume from, in words."""
    previous = latest_checkpoint(output_dir)
    return f"the previous checkpoint {previous!r} is intact" if previous else "no earlier checkpoint exists"


def _disk_full(output_dir, final, cause):
    why = getattr(cause, "strerror", None) or "No space left on device"
    return DiskFullError(f"no space left to write {os.path.basename(final)} in {output_dir!r} ({why}). The partial "
                         f"folder was removed; {previous_kept(output_dir)}. {FULL_DISK_ADVICE}")


def save_checkpoint(output_dir, step, epoch, engine, config, rank, ema_state=None, extra_state=None,
                    json_files=None, weights_format=FullWeights):
    """Collective: every rank calls it. Every rank writes its share of the `engine`'s state
    (dancegrpo.engines), rank 0 the weights (`weights_format`: full transformer folder or LoRA
    adapter), the {file name: JSON value} of `json_files` (the run's config) and the rest. Returns
    the final folder."""
    weights = engine.full_state(weights_format.trainable_only)
    final = checkpoint_dir(output_dir, step, epoch)
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    barrier()
    error = None
    try:
        engine.save_state(tmp)
        if rank == 0:
            state = {"step": step, "epoch": epoch, "lr_scheduler": engine.lr_scheduler.state_dict(),
                     **(extra_state or {})}
            _write_checkpoint(tmp, final, weights, config, ema_state, state, json_files, weights_format)
    except (Exception, CheckpointException) as e:  # noqa: BLE001  (DCP wraps a rank's OSError in its own
        error = e                                    # exception type, a BaseException)
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
    # Agreed over ranks (rank 0's own writes can fail alone), so no rank trains on without the checkpoint.
    if all_reduce_max(float(error is not None), _collective_device()):
        if error is None:
            raise RunHalted(f"{os.path.basename(final)} could not be written (another rank's error says why); "
                            "resume with --resume_from_checkpoint latest")
        cause = _disk_full_cause(error)
        if cause:
            raise _disk_full(output_dir, final, cause) from None
        raise error
    return final


def _collective_device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def checkpoint_problem(folder):
    """Why `folder` cannot resume a run (a short reason), or None when it is complete."""
    manifest = os.path.join(folder, MANIFEST_NAME)
    weights = weights_file(folder)
    if weights is None:
        return f"no {WEIGHTS_NAME} or {LORA_WEIGHTS_NAME}"
    if not os.path.isfile(os.path.join(folder, STATE_NAME)):
        return f"no {STATE_NAME} (weights only)"
    if os.path.isfile(manifest):
        try:
            with open(manifest) as f:
                sizes = json.load(f)
        except ValueError:
            return f"{MANIFEST_NAME} is unreadable"
        for name, size in sizes.items():
            path = os.path.join(folder, name)
            if not os.path.isfile(path) or os.path.getsize(path) != size:
                return f"{name} is {'missing' if not os.path.isfile(path) else 'truncated or changed'}"
    optimizer_dir = os.path.join(folder, OPTIMIZER_DIR)
    if os.path.isdir(optimizer_dir) and not optimizer_shards.is_complete(optimizer_dir):
        return f"no {OPTIMIZER_DIR}/{optimizer_shards.METADATA} (optimizer shards incomplete)"
    try:  # cheap structural checks: a safetensors header, a zip directory (torch.save's format)
        with safe_open(os.path.join(folder, weights), "pt") as f:
            f.keys()
        with zipfile.ZipFile(os.path.join(folder, STATE_NAME)):
            pass
    except Exception as e:  # noqa: BLE001  (any parse failure means "corrupt")
        return f"a corrupt file ({type(e).__name__}: {e})"
    return None


def checkpoints_by_step(output_dir):
    """[(step, path)] of checkpoint-STEP-EPOCH folders, newest first."""
    found = []
    for path in glob.glob(os.path.join(output_dir, "checkpoint-*-*")):
        m = _NAME.fullmatch(os.path.basename(path))
        if m and os.path.isdir(path):
            found.append((int(m.group(1)), int(m.group(2)), path))
    return [(s, p) for s, _, p in sorted(found, reverse=True)]


def latest_checkpoint(output_dir, log=None):
    """The newest checkpoint that can resume the run; newer ones that cannot are reported to `log`."""
    for _, path in checkpoints_by_step(output_dir):
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        if log is not None:
            log(f"warning: skipping {path!r} for resume: {problem}")
    return None


def resolve_resume_path(spec, output_dir, log=print):
    """'latest' -> newest complete checkpoint in output_dir; a path must hold weights."""
    if spec == "latest":
        path = latest_checkpoint(output_dir or ".", log=log)
        if path is None:
            weights_only = sorted(glob.glob(os.path.join(output_dir or ".", "checkpoint-*", WEIGHTS_NAME)))
            hint = (f"; to start from weights only (e.g. upstream's checkpoints) name the folder, e.g. "
                    f"--resume_from_checkpoint {os.path.dirname(weights_only[-1])} with a new --output_dir"
                    if weights_only else "; start without --resume_from_checkpoint")
            raise MissingFileError(f"--resume_from_checkpoint latest: no complete checkpoint-*-* folder in "
                                   f"{output_dir!r}{hint}")
        return path
    if weights_file(spec) is None:
        raise MissingFileError(f"--resume_from_checkpoint {spec!r} holds no {WEIGHTS_NAME} (nor a LoRA adapter); pass a "
                                "checkpoint-STEP-EPOCH folder (this trainer's, or upstream's "
                                "checkpoint-[ema-]STEP-EPOCH for its weights), or 'latest'.")
    problem = checkpoint_problem(spec)
    if problem and not problem.startswith(f"no {STATE_NAME}"):
        raise ConfigError(f"--resume_from_checkpoint {spec!r} is damaged ({problem}); pass an earlier checkpoint "
                          "or 'latest' (which skips damaged ones)")
    return spec


def _delete_beyond(paths, keep, protect):
    """Delete paths[keep:] (newest first), never those in `protect`; returns the deleted."""
    spared = {os.path.abspath(p) for p in protect if p}
    removed = [p for p in paths[keep:] if os.path.abspath(p) not in spared]
    for path in removed:
        shutil.rmtree(path)
    return removed


def prune_checkpoints(output_dir, keep, protect=()):
    """Delete the oldest checkpoints beyond `keep`, never those in `protect` (the one just
    written, the one the run resumed from)."""
    if not keep:
        return []
    return _delete_beyond([p for _, p in checkpoints_by_step(output_dir)], keep, protect)


def make_room(output_dir, keep, writing, protect=()):
    """Before `writing` is written: delete the oldest checkpoints so that with it at most `keep`
    remain (a disk that holds `keep` checkpoints then never needs room for keep + 1), never the
    newest complete one, `writing`'s own folder (replaced only once the new one is whole) or those
    in `protect` (the one the run resumed from)."""
    if not keep:
        return []
    others = [p for _, p in checkpoints_by_step(output_dir) if os.path.abspath(p) != os.path.abspath(writing)]
    return _delete_beyond(others, keep - 1, (*protect, latest_checkpoint(output_dir)))


def load_folder_state(folder):
    return load_file(os.path.join(folder, WEIGHTS_NAME))


def load_weights_into(raw_model, folder):
    """Load a checkpoint's transformer weights into an unwrapped model (before FSDP)."""
    missing, unexpected = raw_model.load_state_dict(load_folder_state(folder), strict=False)
    if missing or unexpected:
        raise ConfigError(f"Checkpoint {folder!r} does not match the model: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")


def load_training_state(folder, engine):
    """Restore the engine's optimizer (and any engine) state and the scheduler (collective, after
    wrapping); returns the saved dict (step, seed...), or None for a weights-only folder."""
    path = os.path.join(folder, STATE_NAME)
    if not os.path.isfile(path):
        return None
    state = torch.load(path, map_location="cpu", weights_only=False)
    engine.load_state(folder, state)
    engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    return state
