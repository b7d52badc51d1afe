"""Checkpoints: a diffusers drop-in transformer folder plus the training state.

    checkpoint-{step}-{epoch}/
        config.json, diffusion_pytorch_model.safetensors   (load with <Model>.from_pretrained(dir))
        training_state.pt                                  (optimizer, scheduler, step, RNG: for resume)
        ema/config.json, ema/diffusion_pytorch_model.safetensors   (with --use_ema)

Written into a temporary folder and renamed into place after the step's update,
so a crash never leaves a half-written checkpoint under the final name.
"""
import glob
import json
import os
import re
import shutil

import torch
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_optimizer_state_dict)

from .errors import ConfigError, MissingFileError

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
STATE_NAME = "training_state.pt"


def _full_options(model):
    # Offloading to CPU while gathering segfaults with FSDP1 on CPU-only runs; on GPU it saves memory.
    on_gpu = any(p.is_cuda for p in model.parameters())
    return StateDictOptions(full_state_dict=True, cpu_offload=on_gpu)


def full_model_state(model):
    """Unsharded, prefix-free state dict (collective under FSDP: call on every rank)."""
    # A copy, not a view: on CPU .cpu() would alias the live parameters, and the EMA
    # checkpoint swaps its values in only while the state is read.
    state = get_model_state_dict(model, options=_full_options(model))
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state.items()}


def write_transformer_folder(folder, state_dict, config):
    os.makedirs(folder, exist_ok=True)
    save_file(state_dict, os.path.join(folder, WEIGHTS_NAME), metadata={"format": "pt"})
    config = {k: v for k, v in dict(config).items() if k != "dtype"}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2, default=list)


def checkpoint_dir(output_dir, step, epoch=0):
    return os.path.join(output_dir, f"checkpoint-{step}-{epoch}")


def save_checkpoint(output_dir, step, epoch, model, config, optimizer, lr_scheduler, rank,
                    ema_state=None, extra_state=None):
    """Collective: every rank calls it; rank 0 writes. Returns the final folder."""
    weights = full_model_state(model)
    optim = get_optimizer_state_dict(model, optimizer, options=_full_options(model))
    final = checkpoint_dir(output_dir, step, epoch)
    if rank == 0:
        tmp = final + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        write_transformer_folder(tmp, weights, config)
        if ema_state is not None:
            write_transformer_folder(os.path.join(tmp, "ema"), ema_state, config)
        torch.save({"step": step, "epoch": epoch, "optimizer": optim,
                    "lr_scheduler": lr_scheduler.state_dict(), **(extra_state or {})},
                   os.path.join(tmp, STATE_NAME))
        if os.path.isdir(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
    return final


def latest_checkpoint(output_dir):
    found = []
    for path in glob.glob(os.path.join(output_dir, "checkpoint-*-*")):
        m = re.fullmatch(r"checkpoint-(\d+)-(\d+)", os.path.basename(path))
        if m and os.path.isfile(os.path.join(path, WEIGHTS_NAME)):
            found.append((int(m.group(1)), path))
    return max(found)[1] if found else None


def resolve_resume_path(spec, output_dir):
    """'latest' -> newest checkpoint in output_dir; a path must hold weights."""
    if spec == "latest":
        path = latest_checkpoint(output_dir or ".")
        if path is None:
            raise MissingFileError(f"--resume_from_checkpoint latest: no checkpoint-*-* folder in {output_dir!r}")
        return path
    if not os.path.isfile(os.path.join(spec, WEIGHTS_NAME)):
        raise MissingFileError(f"--resume_from_checkpoint {spec!r} holds no {WEIGHTS_NAME}; pass a "
                                "checkpoint-STEP-EPOCH folder written by this trainer, or 'latest'.")
    return spec


def load_folder_state(folder):
    return load_file(os.path.join(folder, WEIGHTS_NAME))


def load_weights_into(raw_model, folder):
    """Load a checkpoint's transformer weights into an unwrapped model (before FSDP)."""
    missing, unexpected = raw_model.load_state_dict(load_folder_state(folder), strict=False)
    if missing or unexpected:
        raise ConfigError(f"Checkpoint {folder!r} does not match the model: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")


def load_training_state(folder, model, optimizer, lr_scheduler):
    """Restore optimizer and scheduler (after FSDP wrapping); returns the saved dict (step, rng...)."""
    path = os.path.join(folder, STATE_NAME)
    if not os.path.isfile(path):
        return None
    state = torch.load(path, map_location="cpu", weights_only=False)
    set_optimizer_state_dict(model, optimizer, optim_state_dict=state["optimizer"],
                             options=StateDictOptions(full_state_dict=True))
    lr_scheduler.load_state_dict(state["lr_scheduler"])
    return state
