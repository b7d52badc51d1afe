"""Precomputed prompt embeddings in upstream's layout.

    <dir>/<name>.json          [{"caption": ..., "<field>": "<file>.pt", ...}, ...]
    <dir>/<subfolder>/<file>.pt   one tensor per prompt and embedding kind

The family says which JSON field and sub-folder hold each embedding
(`ModelFamily.embedding_fields`).
"""
import json
import os

import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from ..errors import ConfigError, MissingFileError


class PromptEmbeddingDataset(Dataset):
    def __init__(self, json_path, embedding_fields):
        if not json_path:
            raise MissingFileError("--data_json_path is not set. Point it at the JSON written by the "
                                    "preprocessing script, or use --preset tiny.")
        if not os.path.isfile(json_path):
            raise MissingFileError(f"Prompt data {json_path!r} does not exist. Create it with "
                                    "`python -m dancegrpo.preprocess.<model> ...`, or use --preset tiny.")
        try:
            with open(json_path) as f:
                items = json.load(f)
        except (ValueError, UnicodeDecodeError) as e:
            raise ConfigError(f"Prompt data {json_path!r} is not valid JSON ({'empty file' if os.path.getsize(json_path) == 0 else e}); "
                              "rewrite it with `python -m dancegrpo.preprocess.<model> ...`.") from None
        if not isinstance(items, list) or not items:
            raise ConfigError(f"Prompt data {json_path!r} holds no prompts (expected a non-empty JSON list).")
        self.root = os.path.dirname(os.path.abspath(json_path))
        self.items, self.fields = items, embedding_fields
        for i, item in enumerate(items):
            missing = [field for field, _ in embedding_fields.values() if field not in item]
            if missing or "caption" not in item:
                raise ConfigError(f"Entry {i} of {json_path!r} lacks {missing or ['caption']}")
        self.check_files(json_path)

    def check_files(self, json_path):
        """Every embedding file the JSON names exists (a missing one would otherwise crash a later step)."""
        missing = [self.path_of(i, key) for i in range(len(self.items)) for key in self.fields
                   if not os.path.isfile(self.path_of(i, key))]
        if missing:
            raise MissingFileError(f"{len(missing)} embedding file(s) named in {json_path!r} do not exist, e.g. "
                                   f"{missing[0]!r}; rerun the preprocessing script or remove those entries.")

    def check_layout(self, layout, json_path):
        """Every embedding file is readable and shaped as `layout` says (ModelFamily.embedding_layout),
        all of one kind alike (they are stacked into batches). A torch.save file's size is fixed by its
        tensor's shape and dtype (up to the name stored inside), so every file's size is read and one
        file per kind and size is opened (memory-mapped: its header, not its data); a truncated or
        reshaped file has a size of its own and is opened. 50k prompts x 3 files: 0.8 s (2 CPU cores)."""
        for key, patterns in layout.items():
            first_of_size = {}
            for i in range(len(self.items)):
                first_of_size.setdefault(os.path.getsize(self.path_of(i, key)), self.path_of(i, key))
            shapes = {}
            for path in first_of_size.values():
                shape = _tensor_shape(path, json_path)
                if not shape_fits(shape, patterns):
                    wanted = " or ".join("[" + ", ".join("T" if n is None else str(n) for n in p) + "]" for p in patterns)
                    raise ConfigError(f"embedding file {path!r} holds a {list(shape)} tensor where this model's "
                                      f"{key} is {wanted}: it was made for another model (or another "
                                      f"--max_sequence_length); rerun the preprocessing script with this model")
                shapes.setdefault(shape, path)
            if len(shapes) > 1:
                (a, pa), (b, pb) = list(shapes.items())[:2]
                raise ConfigError(f"the {key} files of {json_path!r} differ in shape ({list(a)} in {pa!r}, {list(b)} "
                                  f"in {pb!r}); they are stacked into batches: rerun the preprocessing script")

    def __len__(self):
        return len(self.items)

    def path_of(self, idx, key):
        field, sub = self.fields[key]
        return os.path.join(self.root, sub, self.items[idx][field])

    def __getitem__(self, idx):
        out = {key: torch.load(self.path_of(idx, key), map_location="cpu", weights_only=True)
               for key in self.fields}
        out["caption"] = self.items[idx]["caption"]
        return out


def shape_fits(shape, patterns):
    """`shape` matches one of `patterns` (tuples of sizes; None: any size)."""
    return any(len(shape) == len(p) and all(w is None or w == n for w, n in zip(p, shape)) for p in patterns)


def _tensor_shape(path, json_path):
    """The shape of the tensor a torch.save file holds, without reading its data where the format allows."""
    errors = []
    for mmap in (True, False):   # the legacy (non-zip) format cannot be memory-mapped
        try:
            value = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        except Exception as e:  # noqa: BLE001  (a damaged file fails in many ways; each is "unreadable")
            errors.append(e)
            continue
        if not torch.is_tensor(value):
            raise ConfigError(f"embedding file {path!r} holds a {type(value).__name__}, not a tensor; rerun the "
                              f"preprocessing script or remove its entry from {json_path!r}")
        return tuple(value.shape)
    raise ConfigError(f"embedding file {path!r} cannot be read ({type(errors[0]).__name__}: "
                      f"{str(errors[0]).splitlines()[0]}): truncated or damaged; rerun the preprocessing script "
                      f"or remove its entry from {json_path!r}")


def collate_prompts(items):
    """Stack tensors; captions stay a list of str (never a tuple, which broke upstream's CPU path)."""
    batch = {k: torch.stack([it[k] for it in items]) for k in items[0] if k != "caption"}
    batch["caption"] = [it["caption"] for it in items]
    return batch


def infinite_prompt_batches(dataset, batch_size, rank, world_size, seed, num_workers=0, start_batch=0):
    """Endless per-rank batches; reshuffles every epoch like upstream's DistributedSampler.

    `start_batch` skips the batches a resumed run already consumed (same order as unbroken).
    """
    if len(dataset) < batch_size * world_size:
        raise ConfigError(f"{len(dataset)} prompts cannot fill a batch of {batch_size} on each of "
                         f"{world_size} ranks; lower --train_batch_size or add prompts.")
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed,
                                 drop_last=True)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True,
                        collate_fn=collate_prompts, num_workers=num_workers)
    epoch, skip = divmod(start_batch, len(loader))
    while True:
        sampler.set_epoch(epoch)
        for i, batch in enumerate(loader):
            if i >= skip:
                yield batch
        skip = 0
        epoch += 1
