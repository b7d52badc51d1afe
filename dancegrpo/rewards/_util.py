"""Helpers shared by the model-based rewards (hpsv2, pickscore, clipscore)."""
import contextlib
import os

import torch

from ..errors import MissingFileError


def option(options, name, default):
    """`options.name` when set (the trainer's argparse Namespace), else `default`; options may be None."""
    value = getattr(options, name, None) if options is not None else None
    return default if value is None else value


def as_device(device):
    return torch.device(device) if device is not None else torch.device("cpu")


def reward_autocast(device, dtype):
    """Autocast to `dtype` on GPU (upstream scores HPSv2 under fp16 autocast); `dtype` None or a
    CPU device: no autocast, float32."""
    if device.type == "cuda" and dtype is not None:
        return torch.autocast("cuda", dtype=dtype)
    return contextlib.nullcontext()


def require_file(path, what, how_to_get):
    if not os.path.isfile(path):
        where = os.path.dirname(path) or "."
        state = "does not exist" if not os.path.isdir(where) else "exists but lacks it"
        raise MissingFileError(f"{what}: file {path!r} not found (folder {where!r} {state}). {how_to_get}")
    return path


def check_pairs(images, prompts):
    if len(images) != len(prompts):
        raise ValueError(f"{len(images)} images but {len(prompts)} prompts: each image is scored against its own prompt")
    if not images:
        raise ValueError("No images to score")


def cosine_pairs(image_features, text_features):
    """Row-wise cosine of image i with text i, in float32 (features normalised here, outside autocast)."""
    img = torch.nn.functional.normalize(image_features.float(), dim=-1)
    txt = torch.nn.functional.normalize(text_features.float(), dim=-1)
    return (img * txt).sum(dim=-1)
