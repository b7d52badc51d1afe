"""Where a LoRA adapter belongs: the transformer class and architecture it was trained on,
recorded in the adapter file's metadata when it is saved and checked wherever an adapter is
loaded (resume, --resume_from_lora_checkpoint, dancegrpo.evaluate).

Without the check an adapter could land on the other family's model: the keys whose module names
exist in both load and the rest are dropped with only a library warning, and the result looks like
a normal, slightly different model. An adapter without the record (written elsewhere) is checked
key by key instead: every key must name a Linear of this model with the factor's shape."""
import json

import torch
from safetensors import safe_open

from ..models.registry import family_of_class

ORIGIN_KEY = "dancegrpo_origin"   # safetensors metadata: JSON of origin_record
PREFIX = "transformer."   # diffusers' key prefix of a transformer adapter


class AdapterMismatch(ValueError):
    """The adapter does not belong to this model; the message names both sides."""


def architecture(config):
    """The config entries that shape the model (diffusers' bookkeeping, the `_`-keys, left out)."""
    return {k: v for k, v in dict(config).items() if not k.startswith("_")}


def origin_record(config):
    """What the saved adapter records of the model it was trained on."""
    arch = json.loads(json.dumps(architecture(config), default=list))   # tuples -> lists, as read back
    return {"transformer": dict(config).get("_class_name"), "base": dict(config).get("_name_or_path"),
            "architecture": arch}


def read_origin(path):
    """The record in an adapter file, or None (an adapter written elsewhere)."""
    with safe_open(path, "pt") as f:
        metadata = f.metadata() or {}
    return json.loads(metadata[ORIGIN_KEY]) if ORIGIN_KEY in metadata else None


def _label(cls_name):
    family = family_of_class(cls_name)
    return f"{cls_name} ({family})" if family else str(cls_name)


def origin_problem(record, config, path):
    """Why the adapter at `path`, recorded as `record`, cannot load on a model with `config`; None if it can."""
    here_cls = dict(config).get("_class_name")
    if record["transformer"] != here_cls:
        return (f"the adapter {path!r} was trained on a {_label(record['transformer'])} but this model is a "
                f"{_label(here_cls)}: load it with the trainer / --family of its own family, on its base model")
    here = origin_record(config)["architecture"]
    # Keys on one side only are not compared: a config.json read from disk may leave defaults out.
    differing = sorted(k for k in set(here) & set(record["architecture"]) if here[k] != record["architecture"][k])
    if differing:
        shown = ", ".join(f"{k} {record['architecture'].get(k)} -> {here.get(k)}" for k in differing[:4])
        return (f"the adapter {path!r} was trained on the base {record['base']!r}, whose {here_cls} differs from "
                f"this one ({shown}): pass its base model")
    return None


def key_problem(model, path):
    """An adapter file with no record: every key must be consumed by a Linear of `model` of the factor's
    shape (the check a library's loader does not make: it drops what does not fit with a warning)."""
    modules = dict(model.named_modules())
    unfit = []
    with safe_open(path, "pt") as f:
        for key in f.keys():
            name = key[len(PREFIX):] if key.startswith(PREFIX) else key
            module_name, _, factor = name.rpartition(".lora_")
            layer = getattr(modules.get(module_name), "base_layer", modules.get(module_name))  # peft wraps it
            shape = tuple(f.get_slice(key).get_shape())
            fits = isinstance(layer, torch.nn.Linear) and len(shape) == 2 and (
                (factor == "A.weight" and shape[1] == layer.in_features)
                or (factor == "B.weight" and shape[0] == layer.out_features))
            if not fits:
                unfit.append(key)
    if unfit:
        return (f"{len(unfit)} key(s) of the adapter {path!r} fit no layer of this "
                f"{type(model).__name__} (e.g. {unfit[:2]}): it was trained on another model; pass its base model")
    return None


def check_adapter(path, model):
    """Raise AdapterMismatch unless the adapter file at `path` belongs to `model` (its record first, then
    its keys), before anything of it is loaded."""
    record = read_origin(path)
    problem = origin_problem(record, model.config, path) if record else None
    problem = problem or key_problem(model, path)
    if problem:
        raise AdapterMismatch(problem)
