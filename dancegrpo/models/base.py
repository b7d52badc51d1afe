"""The interface every model family implements, plus packing helpers they share."""
import os

import numpy as np
import torch
from PIL import Image
from ..errors import ConfigError, MissingFileError
from ..utils.precision import decode_context  # noqa: F401 (the families decode through it)


def pack_latents(latents, batch_size, num_channels_latents, height, width):
    """[B, C, H, W] -> [B, (H/2)(W/2), 4C]: 2x2 patches become tokens (Flux layout)."""
    x = latents.view(batch_size, num_channels_latents, height // 2, 2, width // 2, 2)
    x = x.permute(0, 2, 4, 1, 3, 5)
    return x.reshape(batch_size, (height // 2) * (width // 2), num_channels_latents * 4)


def unpack_latents(latents, height, width, vae_scale_factor):
    """Inverse of pack_latents for an image of height x width pixels."""
    batch_size, _, channels = latents.shape
    lh = 2 * (int(height) // (vae_scale_factor * 2))
    lw = 2 * (int(width) // (vae_scale_factor * 2))
    x = latents.view(batch_size, lh // 2, lw // 2, channels // 4, 2, 2)
    x = x.permute(0, 3, 1, 4, 2, 5)
    return x.reshape(batch_size, channels // 4, lh, lw)


def prepare_latent_image_ids(batch_size, height, width, device, dtype):
    """Token position ids [(H)(W), 3] = (0, row, col); Flux takes them without a batch dim."""
    ids = torch.zeros(height, width, 3)
    ids[..., 1] = torch.arange(height)[:, None]
    ids[..., 2] = torch.arange(width)[None, :]
    return ids.reshape(height * width, 3).to(device=device, dtype=dtype)


def model_config(transformer):
    """The diffusers config of a transformer, also through a wrapper that has a `config` of its own
    (a DeepSpeed engine's is its JSON config; FSDP forwards attributes)."""
    return getattr(transformer, "module", transformer).config


def latents_to_pil(images):
    """Decoder output in [-1, 1], [B, 3, H, W] -> list of RGB PIL images."""
    arr = ((images.float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
    arr = arr.permute(0, 2, 3, 1).cpu().numpy()
    return [Image.fromarray(np.ascontiguousarray(a)) for a in arr]


TILED_DECODE_MIN_PX = 512


def wants_tiled_decode(device, height, width):
    """Upstream decodes with the VAE's tiling on at its 720 px (GPU memory); CPU runs and small
    images decode whole."""
    return torch.device(device).type == "cuda" and max(height, width) >= TILED_DECODE_MIN_PX


def require_model_folder(path, subfolders, preset_hint):
    """Fail early, naming the fix, when the diffusers model folder is not there."""
    if not path:
        raise MissingFileError("--pretrained_model_name_or_path is not set. Point it at a local diffusers "
                                f"model folder, or run the embedded default with {preset_hint}.")
    missing = [s for s in subfolders if not os.path.isfile(os.path.join(path, s, "config.json"))]
    if missing:
        raise MissingFileError(
            f"Model folder {path!r} lacks {', '.join(s + '/config.json' for s in missing)}. Download the "
            f"weights there (e.g. `huggingface-cli download <repo> --local-dir {path}`), or run the embedded "
            f"default with {preset_hint}.")


def check_model_files(folder, fix):
    """config.json parses and every *.safetensors header is whole, else one message naming the file."""
    import glob
    import json
    from safetensors import safe_open
    config = os.path.join(folder, "config.json")
    try:
        with open(config) as f:
            parsed = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"{config!r} is not valid JSON ({e}); {fix}") from None
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        try:
            with safe_open(path, "pt") as f:
                f.keys()
        except Exception as e:  # noqa: BLE001  (the safetensors error type is not public API)
            raise ConfigError(f"{path!r} is corrupt or truncated ({e}); {fix}") from None
    return parsed


def require_family(config, expected, folder):
    """The transformer folder holds `expected` (a diffusers class name), else one line naming the trainer
    for what it holds."""
    found = config.get("_class_name")
    if found == expected:
        return
    from .registry import family_of_class   # to name the right trainer for another family's folder
    family = family_of_class(found)
    fix = (f"train it with `python -m dancegrpo.train_grpo_{family}`, or point --pretrained_model_name_or_path at a {expected} "
           "model folder" if family else f"point --pretrained_model_name_or_path at a {expected} model folder")
    raise ConfigError(f"{folder!r} holds a {found or 'model without _class_name in its config.json'}, not this "
                      f"trainer's {expected}: {fix}")


class ModelFamily:
    """What the shared trainer needs from a model family.

    cond: a dict of batch-first tensors (one row per sample) from the dataset;
    latents: packed tokens [B, L, C]; every method is pure tensors in, tensors out.
    """
    name = ""
    latent_channels = 16
    vae_scale_factor = 8
    # Dataset layout: cond key -> (JSON field holding the file name, sub-folder of the JSON's folder).
    embedding_fields = {}
    # Transformer block classes that FSDP wraps and activation checkpointing recomputes.
    block_class_names = ()
    # FSDP compute / reduce / buffer precision on GPU when --master_weight_type is not given
    # (upstream: Flux fp32 + bf16 autocast, Qwen-Image bf16 MixedPrecision).
    gpu_fsdp_weight_type = "fp32"

    def __init__(self, args):
        self.height, self.width = args.h, args.w
        # The decode's precision follows the run's (dancegrpo.utils.precision.decode_context).
        self.mixed_precision = getattr(args, "mixed_precision", None)

    # diffusers classes of the transformer and the VAE, loaded from <folder>/transformer and <folder>/vae.
    transformer_class_name = ""
    vae_class_name = ""

    # Shapes of one prompt's embedding files, per cond key: tuples of sizes (None: any), sizes from the
    # transformer's config; every prompt's must be alike (they are stacked into batches).
    def embedding_layout(self, config):
        raise NotImplementedError

    def check_files(self, args):
        """Before anything loads: the model folders are there, whole (config.json parses, safetensors
        headers read) and hold this family's transformer; returns the transformer's config."""
        path = args.pretrained_model_name_or_path
        require_model_folder(path, ["transformer", "vae"], "--preset tiny")
        fix = "download the weights again (or delete the preset's cache folder to rebuild it)"
        folder = os.path.join(args.dit_model_name_or_path or path, "transformer")
        config = check_model_files(folder, fix)
        require_family(config, self.transformer_class_name, folder)
        check_model_files(os.path.join(args.vae_model_path or path, "vae"), fix)
        return config

    def load(self, args, device):
        """(transformer in float32 = master weights, frozen vae: bf16 and tiled on GPU) from a local
        diffusers folder."""
        import diffusers
        import torch
        path = args.pretrained_model_name_or_path
        self.check_files(args)
        transformer = getattr(diffusers, self.transformer_class_name).from_pretrained(
            args.dit_model_name_or_path or path, subfolder="transformer", torch_dtype=torch.float32)
        vae_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        vae = getattr(diffusers, self.vae_class_name).from_pretrained(
            args.vae_model_path or path, subfolder="vae", torch_dtype=vae_dtype)
        if wants_tiled_decode(device, self.height, self.width):
            vae.enable_tiling()
        return transformer, vae.to(device).eval().requires_grad_(False)

    @property
    def latent_hw(self):
        """Latent height and width (before 2x2 packing) of an h x w image."""
        return self.height // self.vae_scale_factor, self.width // self.vae_scale_factor

    def initial_noise(self, n, generator, device):
        """Packed initial latents [n, L, C] drawn with `generator`."""
        raise NotImplementedError

    def predict(self, transformer, latents, timesteps, cond):
        """Velocity for packed latents [B, L, C] at model timesteps [B] in [0, 1]."""
        raise NotImplementedError

    def decode(self, vae, latents):
        """Packed x0 latents [B, L, C] -> list of PIL images."""
        raise NotImplementedError

    def block_classes(self, transformer):
        """The transformer's block classes, found by name in the loaded model."""
        return tuple({type(m) for m in transformer.modules() if type(m).__name__ in self.block_class_names})
