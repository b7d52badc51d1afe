"""Embedded presets: small models and prompt embeddings built offline, seeded.

A preset writes a real diffusers model folder (transformer/, vae/) and an
embedding folder in upstream's layout, then the trainer loads both through the
SAME `from_pretrained` / dataset code a GPU user runs with real weights. A
preset only sets defaults: flags given on the command line win.
"""
import json
import os
import shutil
import uuid

from .errors import MissingFileError
from .models.registry import family_part

PROMPTS_FILE = os.path.join(os.path.dirname(__file__), "assets", "prompts.txt")
PRESET_VERSION = 1  # bump when a preset's models or data change, so stale caches are rebuilt


def bundled_prompts(n):
    with open(PROMPTS_FILE) as f:
        prompts = [line.strip() for line in f if line.strip()]
    return prompts[:n]


def family_presets(family):
    """{preset name: spec} of a family (its package's presets part, dancegrpo.models.registry)."""
    return family_part(family, "presets").PRESETS


def preset_names(family):
    return sorted(family_presets(family))


def preset_spec(family, name):
    try:
        return family_presets(family)[name]
    except KeyError:
        raise ValueError(f"Unknown preset {name!r} for {family}; available: {preset_names(family)}") from None


def preset_root(cache_dir, family, name):
    return os.path.join(cache_dir, "presets", f"{family}-{name}-v{PRESET_VERSION}")


def materialize_preset(family, name, cache_dir, seed=0):
    """Build the preset's model folder and prompt data once; return its root.

    Built in a private temp folder and renamed into place, so concurrent ranks or
    an interrupted build never leave a half-written preset behind.
    """
    import diffusers
    import torch
    spec = preset_spec(family, name)
    if "shipped" in spec:  # trained models that come with the package
        if not os.path.isfile(os.path.join(spec["shipped"], "transformer", "config.json")):
            raise MissingFileError(f"the {name} preset's models are missing from {spec['shipped']!r}; rebuild them "
                                   f"with `python -m dancegrpo.digits.build --family {family} --out {spec['shipped']}`")
        return spec["shipped"]
    root = preset_root(cache_dir, family, name)
    if os.path.isfile(os.path.join(root, "COMPLETE")):
        return root
    tmp = f"{root}.tmp-{uuid.uuid4().hex[:8]}"
    os.makedirs(tmp)
    try:
        for i, part in enumerate(("transformer", "vae")):
            cls_name, config = spec[part]
            torch.manual_seed(seed + i)
            getattr(diffusers, cls_name)(**config).save_pretrained(os.path.join(tmp, part))
        data_dir = os.path.join(tmp, "data")
        write = family_part(family, "embeddings").write_embeddings
        items = write(data_dir, bundled_prompts(spec["num_prompts"]), spec["text"])
        with open(os.path.join(data_dir, "prompts.json"), "w") as f:
            json.dump(items, f, indent=1)
        open(os.path.join(tmp, "COMPLETE"), "w").close()
        try:
            os.rename(tmp, root)
        except OSError:  # another process finished first
            if not os.path.isfile(os.path.join(root, "COMPLETE")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root


def spec_defaults_for_world(defaults, num_prompts, world_size):
    """Under torchrun, split the preset's per-step prompts and GA over the ranks when one rank
    cannot hold them all: the ranks then train on the same global batch, and FSDP's mean over
    ranks of (per-rank sum / GA) equals the single-process gradient."""
    defaults = dict(defaults)
    if world_size > 1 and defaults["train_batch_size"] * world_size > num_prompts:
        defaults["train_batch_size"] = max(1, num_prompts // world_size)
        defaults["gradient_accumulation_steps"] = max(1, defaults["gradient_accumulation_steps"] // world_size)
    return defaults


def uneven_split(family, name, world_size):
    """Why the preset's per-step batch cannot be split over world_size ranks as one process trains
    it (None when it can, or when each rank holds the whole batch): the ranks would train fewer
    prompts than the preset's step, or accumulate over other counts."""
    spec = preset_spec(family, name)
    defaults = spec["defaults"]
    tbs, ga, num_prompts = defaults["train_batch_size"], defaults["gradient_accumulation_steps"], spec["num_prompts"]
    if world_size <= 1 or tbs * world_size <= num_prompts:
        return None
    if num_prompts % world_size == 0 and ga % world_size == 0:
        return None
    fits = [str(n) for n in range(1, num_prompts + 1) if num_prompts % n == 0 and ga % n == 0]
    generations = defaults["num_generations"] if defaults.get("use_group") else 1
    sizes = f"{', '.join(fits[:-1])} or {fits[-1]} ranks" if len(fits) > 1 else "1 rank"
    return (f"--preset {name} trains {num_prompts} prompts x {generations} generations per step (GA {ga}), "
            f"which {world_size} ranks cannot split evenly: launch {sizes}, or give --train_batch_size and "
            "--gradient_accumulation_steps for this world size yourself")


def preset_defaults(family, name, cache_dir):
    """Materialize the preset and return the flag defaults it sets."""
    from .utils.communications import launch_world_size
    root = materialize_preset(family, name, cache_dir)
    spec = preset_spec(family, name)
    defaults = spec_defaults_for_world(spec["defaults"], spec["num_prompts"], launch_world_size())
    defaults.update(pretrained_model_name_or_path=root,
                    data_json_path=os.path.join(root, "data", "prompts.json"))
    return defaults
