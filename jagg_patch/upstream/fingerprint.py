"""What an upstream trainer file offers against what the adapter relies on (jagg_patch.seams,
UPSTREAM_*): the family, each function's parameters, the rollout's return arity, and the source
of the function the adapter restates.

A changed parameter list or arity stops at once with one line (UpstreamChanged), unless
allow_changes turns it into a warning; a changed restated source only warns
(UpstreamSourceChanged), naming the docs page to re-read.
"""
import ast
import hashlib
import inspect
import textwrap
import warnings

from ..seams import (SeamError, UPSTREAM_CALLED, UPSTREAM_COMMIT, UPSTREAM_ROLLOUT_VALUES, UPSTREAM_SEAMS,
                     UPSTREAM_SOURCE_HASHES)

DOCS_PAGE = 'docs/upstream_adapter.md'
RESTATED = ("train_one_step",)


class UpstreamChanged(SeamError):
    """The upstream file no longer offers what jagg_patch.upstream relies on."""


class UpstreamSourceChanged(UserWarning):
    """A function the adapter restates differs from the source it was written against."""


def param_names(fn):
    return tuple(inspect.signature(fn).parameters)


def family_of(module):
    """The trainer family, told by train_one_step's parameters."""
    fn = getattr(module, "train_one_step", None)
    if not callable(fn):
        raise UpstreamChanged(f"{_file(module)} has no function train_one_step; jagg_patch.upstream replaces it "
                              "(is this an upstream DanceGRPO trainer, fastvideo/train_grpo_*.py?)")
    params = param_names(fn)
    if "loader" in params:
        return "flux" if "ema_handler" in params else "flux_lora"
    if "prompt_embeds" in params:
        return "qwenimage"
    raise UpstreamChanged(f"{_file(module)}: train_one_step{params} matches none of upstream's trainers "
                          f"({', '.join(UPSTREAM_SEAMS)}: Flux's takes `loader`, Qwen-Image's `prompt_embeds`)")


def _file(module):
    return getattr(module, "__file__", None) or module.__name__


def _difference(found, expected):
    removed = [p for p in expected if p not in found]
    added = [p for p in found if p not in expected]
    if removed or added:
        return ", ".join(([f"lost {removed}"] if removed else []) + ([f"gained {added}"] if added else []))
    return "same names in another order"


def _returned_tuple_sizes(fn):
    """Sizes of the literal tuples fn itself returns (not its nested functions); empty when it returns
    none or its source is not readable."""
    try:
        (definition,) = ast.parse(textwrap.dedent(inspect.getsource(fn))).body
    except (OSError, TypeError, SyntaxError, ValueError):
        return set()
    sizes, todo = set(), list(definition.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Tuple):
            sizes.add(len(node.value.elts))
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            todo.extend(ast.iter_child_nodes(node))
    return sizes


def signature_changes(module, family):
    """One line per difference between the module and what the adapter relies on."""
    changes = []
    for name, expected in UPSTREAM_SEAMS[family].items():
        fn = getattr(module, name, None)
        if not callable(fn):
            changes.append(f"{name} is missing (expected {name}{expected})")
            continue
        found = param_names(fn)
        if found != expected:
            changes.append(f"{name} takes {found}, expected {expected} ({_difference(found, expected)})")
    for name in UPSTREAM_CALLED:
        if not callable(getattr(module, name, None)):
            changes.append(f"{name} is missing")
    sizes = _returned_tuple_sizes(getattr(module, "sample_reference_model", None))
    if sizes - {UPSTREAM_ROLLOUT_VALUES}:
        changes.append(f"sample_reference_model returns {sorted(sizes)} values, expected {UPSTREAM_ROLLOUT_VALUES}")
    return changes


def source_hash(fn):
    """sha256 (16 hex digits) of fn's syntax tree: comments, blank lines and layout do not count."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    return hashlib.sha256(ast.dump(tree, include_attributes=False).encode()).hexdigest()[:16]


def fingerprint(module):
    """Everything the checks compare, as recorded for a release: family, parameter lists, source hashes."""
    family = family_of(module)
    return {"family": family,
            "parameters": {name: param_names(getattr(module, name)) for name in UPSTREAM_SEAMS[family]
                           if callable(getattr(module, name, None))},
            "source_hashes": {name: source_hash(getattr(module, name)) for name in RESTATED}}


def rollout_changed(family, count):
    """The message for a sample_reference_model that returned `count` values."""
    return (f"upstream changed sample_reference_model: it returned {count} values, jagg_patch.upstream expects "
            f"{UPSTREAM_ROLLOUT_VALUES} (upstream {UPSTREAM_COMMIT}, {family}); see {DOCS_PAGE}")


def check_upstream(module, allow_changes=False, source_hashes=None, log=print):
    """Check a loaded upstream trainer module before the first step; returns its family.

    source_hashes: {(family, function): hash or None}; default the recorded UPSTREAM_SOURCE_HASHES."""
    family = family_of(module)
    changes = signature_changes(module, family)
    if changes:
        line = (f"upstream changed what jagg_patch.upstream relies on in {_file(module)} ({family}, written "
                f"against upstream {UPSTREAM_COMMIT}): {'; '.join(changes)}. See {DOCS_PAGE}")
        if not allow_changes:
            raise UpstreamChanged(line + "; --jagg_allow_upstream_changes runs anyway")
        warnings.warn(UpstreamSourceChanged(line + " (running anyway: --jagg_allow_upstream_changes)"), stacklevel=2)
    recorded = UPSTREAM_SOURCE_HASHES if source_hashes is None else source_hashes
    for name in RESTATED:
        expected, found = recorded.get((family, name)), source_hash(getattr(module, name))
        if expected is None:
            log(f"jagg_patch.upstream: note: no recorded source hash of {family} {name} at upstream "
                f"{UPSTREAM_COMMIT} in this release, so a change to it cannot be detected (this file's: {found}; "
                f"see {DOCS_PAGE})")
        elif found != expected:
            warnings.warn(UpstreamSourceChanged(
                f"upstream's {name} in {_file(module)} is not the source jagg_patch.upstream restates (upstream "
                f"{UPSTREAM_COMMIT}, {family}: hash {expected}, found {found}): re-read {DOCS_PAGE}, "
                f"\"When the fingerprint fires\", and compare the rules it lists with this {name}"), stacklevel=2)
    return family
