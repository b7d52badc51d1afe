"""Loading what a run wrote or a user downloaded, for evaluation: a transformer folder (a trainer
checkpoint, its ema/, or a base model's transformer/), a LoRA checkpoint on its base model, and
the VAE; each checked before it loads, with one line naming the fix."""
import json
import os

import torch

from .adapters.origin import AdapterMismatch, check_adapter, origin_problem, read_origin
from .errors import ConfigError, MissingFileError

WEIGHTS_FILES = ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.safetensors.index.json",
                 "diffusion_pytorch_model.bin")
LORA_FILE = "pytorch_lora_weights.safetensors"


def transformer_folder(path):
    """(folder, subfolder) of the transformer in a checkpoint or base model folder; (path, LORA_FILE)
    for a LoRA checkpoint (an adapter on the base model)."""
    if not os.path.exists(path):
        raise MissingFileError(f"checkpoint {path!r} does not exist{_what_is_beside(path)}")
    if os.path.isfile(os.path.join(path, LORA_FILE)):
        return path, LORA_FILE
    if os.path.isfile(os.path.join(path, "config.json")) and any(
            os.path.isfile(os.path.join(path, f)) for f in WEIGHTS_FILES):
        return path, None
    if os.path.isfile(os.path.join(path, "transformer", "config.json")):
        return path, "transformer"
    raise ConfigError(f"Checkpoint {path!r} is neither a transformer folder (config.json + "
                      f"{WEIGHTS_FILES[0]}, as the trainer writes checkpoint-STEP-EPOCH/), a LoRA checkpoint "
                      f"({LORA_FILE}), nor a base model folder with transformer/config.json")


def _what_is_beside(path):
    """For a missing checkpoint in a run folder (one a running run's --checkpoints_total_limit may have
    pruned): the checkpoints that folder holds now."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.basename(os.path.normpath(path)).startswith("checkpoint-") or not os.path.isdir(folder):
        return ""
    held = sorted(name for name in os.listdir(folder) if name.startswith("checkpoint-") and not name.endswith(".tmp"))
    return (f" (a run's --checkpoints_total_limit may have deleted it); {folder!r} holds "
            f"{', '.join(held) if held else 'no checkpoint'}")


def _class_problem(path, folder, sub, cls_name):
    """A transformer folder that holds another family's model, in one line (None when it matches)."""
    try:
        with open(os.path.join(folder, sub or "", "config.json")) as f:
            found = json.load(f).get("_class_name")
    except (OSError, ValueError):
        return None   # unreadable: the load names it
    if found and found != cls_name:
        return f"{path!r} holds a {found}, not a {cls_name}; pick the matching --family"
    return None


def precheck_checkpoint(path, base, cls_name):
    """Before anything loads: `path` is a transformer, and an adapter comes with its base and was
    recorded (when it was) as trained on this family's transformer and the base's architecture."""
    folder, sub = transformer_folder(path)
    if sub != LORA_FILE:
        problem = _class_problem(path, folder, sub, cls_name)
        if problem:
            raise ConfigError(problem)
        return
    if not base:
        raise ConfigError(f"{path!r} is a LoRA adapter: pass --pretrained_model_name_or_path (its base model)")
    record = read_origin(os.path.join(folder, LORA_FILE))
    if record is None:
        return   # checked key by key once the base is loaded
    base_folder, base_sub = transformer_folder(base)
    if base_sub == LORA_FILE:
        raise ConfigError(f"--pretrained_model_name_or_path {base!r} is a LoRA adapter, not a base model")
    with open(os.path.join(base_folder, base_sub or "", "config.json")) as f:
        config = {**json.load(f), "_class_name": cls_name}
    problem = origin_problem(record, config, path)
    if problem:
        raise ConfigError(problem)


def load_transformer(cls_name, path, device, base=None):
    """The transformer of `path`; a LoRA checkpoint is loaded onto `base`'s transformer with
    diffusers' load_lora_adapter (alpha from the adapter's stored LoraConfig)."""
    import diffusers
    folder, sub = transformer_folder(path)
    if sub == LORA_FILE:
        if not base:
            raise ConfigError(f"{path!r} is a LoRA adapter: pass --pretrained_model_name_or_path (its base model)")
        model = load_transformer(cls_name, base, device)
        try:
            check_adapter(os.path.join(folder, LORA_FILE), model)
        except AdapterMismatch as e:
            raise ConfigError(str(e)) from None
        model.load_lora_adapter(folder, prefix="transformer", weight_name=LORA_FILE)
        return model.eval().requires_grad_(False)
    problem = _class_problem(path, folder, sub, cls_name)
    if problem:
        raise ConfigError(problem)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = getattr(diffusers, cls_name).from_pretrained(folder, subfolder=sub, torch_dtype=dtype)
    return model.to(device).eval().requires_grad_(False)


def load_vae(cls_name, args, device):
    import diffusers
    root = args.vae_model_path or args.pretrained_model_name_or_path
    if not os.path.isfile(os.path.join(root, "vae", "config.json")):
        raise MissingFileError(f"VAE folder {os.path.join(root, 'vae')!r} lacks config.json; point "
                        "--pretrained_model_name_or_path (or --vae_model_path) at the base model folder")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(diffusers, cls_name).from_pretrained(root, subfolder="vae", torch_dtype=dtype) \
        .to(device).eval().requires_grad_(False)
