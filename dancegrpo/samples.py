"""Sample grids while training: fixed prompts (rows) x fixed noise (columns), sampled with the
deterministic Euler ODE on the run's own schedule, so grids of different steps differ only by
the weights. Written by rank 0 as <output_dir>/samples/step-XXXXXX.png (--sample_every N)."""
import os

import torch
from PIL import Image

from .algo.sampling import denoise, ode
from .utils.atomic import write_atomically

COLUMNS = 4
MAX_ROWS = 10
SEED = 1234


def grid_rows(captions, label_of=None):
    """Dataset indices of the row prompts: where every caption has a label (`label_of(caption)`,
    ValueError where one has none: the digits world's digit), one prompt per label in label order;
    otherwise the first MAX_ROWS prompts."""
    first = {}
    try:
        if label_of is None:
            raise ValueError("no labels")
        for i, caption in enumerate(captions):
            first.setdefault(label_of(caption), i)
    except ValueError:
        return list(range(min(MAX_ROWS, len(captions))))
    return [first[d] for d in sorted(first)]


@torch.no_grad()
def sample_latents(family, predict, sigmas, timesteps, cond, columns=COLUMNS, seed=SEED):
    """x0 latents, row-major: each row of `cond` (batch-first) with the same `columns` noises.
    `predict(latents, timesteps, cond)` is the trainer's velocity call (collective under FSDP:
    every rank calls this; decoding is left to the caller)."""
    rows = next(iter(cond.values())).shape[0]
    device = next(iter(cond.values())).device
    generator = torch.Generator(device=device).manual_seed(seed)
    z = family.initial_noise(columns, generator, device).repeat(rows, 1, 1)
    cond = {k: v.repeat_interleave(columns, dim=0) for k, v in cond.items()}
    return denoise(lambda x, t: predict(x, t, cond), z, sigmas, timesteps, ode(sigmas)).x0.float()


def tile(images, columns=COLUMNS, max_side=None, background="black"):
    """Images row-major on a grid of `columns`; each scaled down to `max_side` px on its longest
    side when it is larger."""
    w, h = images[0].size
    scale = min(1.0, max_side / max(w, h)) if max_side else 1.0
    tw, th = max(1, round(w * scale)), max(1, round(h * scale))
    rows = (len(images) + columns - 1) // columns
    grid = Image.new("RGB", (columns * tw, rows * th), background)
    for i, im in enumerate(images):
        im = im.convert("RGB")
        grid.paste(im.resize((tw, th)) if scale < 1 else im, ((i % columns) * tw, (i // columns) * th))
    return grid


def save_grid(images, output_dir, step, columns=COLUMNS):
    folder = os.path.join(output_dir, "samples")
    os.makedirs(folder, exist_ok=True)
    grid = tile(images, columns)
    return write_atomically(os.path.join(folder, f"step-{step:06d}.png"), grid.save)   # a full disk: no half grid
