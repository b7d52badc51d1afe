"""The one table of model families: name -> the package that holds everything of the family.

A family package (`dancegrpo/models/<family>/`, as torchtitan's models/<name>/) has:
    __init__.py    FAMILY: the ModelFamily subclass (load, inputs, predict, decode)
    model.py       that class
    embeddings.py  save_embeddings(root, entries) / write_embeddings(root, prompts, text): the
                   prompt-embedding file layout the trainer reads
    presets.py     PRESETS: {preset name: spec} (tiny, small: built at first use; digits, digits_large:
                   shipped)
    digits.py      WORLDS: {world name: build spec} (DigitsWorld: VAE, transformer, text, conditions;
                   DigitsLargeWorld: the deeper, less linear transformer)
    preprocess.py  ENCODER: the model part of the prompt-embedding writer (the real text encoders;
                   dancegrpo.preprocess.common runs it)
The trainer, presets, evaluate, the digits build and preprocessing look a family up here and
import only the part they need, when they need it. Adding a family is one package and one line
in FAMILY_PACKAGES (or `register_family` at run time, for a family outside this repository).
"""
import importlib

from ..errors import ConfigError

FAMILY_PACKAGES = {
    "flux": "dancegrpo.models.flux",
    "qwenimage": "dancegrpo.models.qwenimage",
}
PARTS = (None, "embeddings", "presets", "digits", "preprocess")


def register_family(name, package):
    """Add a family (its package's import name); registering the same package again changes nothing."""
    if FAMILY_PACKAGES.get(name, package) != package:
        raise ValueError(f"model family {name!r} is already {FAMILY_PACKAGES[name]!r}; choose another name")
    FAMILY_PACKAGES[name] = package


def unregister_family(name):
    FAMILY_PACKAGES.pop(name, None)


def family_names():
    return sorted(FAMILY_PACKAGES)


def family_part(name, part=None):
    """The family's package (part None) or one of its PARTS modules, imported."""
    if name not in FAMILY_PACKAGES:
        raise ConfigError(f"unknown model family {name!r}; known: {family_names()}")
    if part not in PARTS:
        raise ValueError(f"a family package has no part {part!r}; parts: {PARTS[1:]}")
    package = FAMILY_PACKAGES[name]
    return importlib.import_module(package if part is None else f"{package}.{part}")


def family_class(name):
    """The family's ModelFamily subclass."""
    return family_part(name).FAMILY


def family_of_class(transformer_class_name):
    """The family whose transformer is that diffusers class (None if none is)."""
    for name in family_names():
        if family_class(name).transformer_class_name == transformer_class_name:
            return name
    return None
