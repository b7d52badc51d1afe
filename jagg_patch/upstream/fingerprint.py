"""What an upstream trainer file offers against what the adapter relies on (jagg_patch.seams,
UPSTREAM_*): the family, each function's parameters, the rollout's return arity, the reward file
its train_one_step appends to, and which known release its train_one_step is (by token hash).

A changed parameter list or arity stops at once with one line (UpstreamChanged), unless
allow_changes turns it into a warning (UpstreamSourceChanged); a train_one_step that is no known
release, or no family's, is said in Trainer.unknown (it then runs as it is, its backward deferred:
jagg_patch.upstream.own_step). A file the adapter cannot run stops with one line (UpstreamUnsupported).
"""
import ast
import inspect
import os
import warnings
from dataclasses import dataclass

from ..seams import (SeamError, UPSTREAM_CALLED, UPSTREAM_COMMIT, UPSTREAM_FAMILY_PARAMETERS, UPSTREAM_OWN_STEP_RELEASES,
                     UPSTREAM_PREPARE_FILES, UPSTREAM_RELEASES, UPSTREAM_REWARD_NAMES, UPSTREAM_ROLLOUT_VALUES,
                     UPSTREAM_SEAMS, UPSTREAM_TRAIN_ONE_STEP, UPSTREAM_TRAINER_FILES)
from .tokenhash import function_source, token_hash, token_hashes

DOCS_PAGE = "docs/upstream_adapter.md"
DOCS_SECTION = f'{DOCS_PAGE}, "When the fingerprint fires"'
SUPPORTED = ", ".join(UPSTREAM_TRAINER_FILES)


class UpstreamChanged(SeamError):
    """The upstream file no longer offers what jagg_patch.upstream relies on."""


class UpstreamUnsupported(SeamError):
    """The file is none of the upstream trainers jagg_patch.upstream runs."""


class UpstreamSourceChanged(UserWarning):
    """What the adapter relies on changed, and it runs anyway (--jagg_allow_upstream_changes)."""


@dataclass(frozen=True)
class Trainer:
    """What the checks found: the family (None: none the restated step is written for), the known
    release (None: an unknown source), what the restated step takes from upstream's own train_one_step
    (the reward files, in its order, and the print labels), and `unknown`: why the restated step does
    not run it (None where it is a known release)."""
    family: str
    file: str
    release: object
    reward_files: tuple
    reward_label: str
    gathered_labels: tuple
    unknown: str = None

    def release_text(self):
        """The known release's files and commits, this file's only where the release lists several
        (Flux bbf5278's train_one_step is the LoRA trainer's, token for token); None when unknown."""
        if self.release is None:
            return None
        parts = self.release.commits.split(", ")
        return next((p for p in parts if p.split(" ")[0] == os.path.basename(self.file)), self.release.commits)

    def describe(self):
        known = self.release_text()
        known = f"train_one_step of {known}" if known else "train_one_step of no known release"
        files = ", ".join(self.reward_files) or "none named"
        return (f"{os.path.basename(self.file)}: family {self.family or 'unknown'}, {known}, "
                f"reward file{'s' if len(self.reward_files) > 1 else ''} {files}")


def param_names(fn):
    return tuple(inspect.signature(fn).parameters)


def _file(module):
    return getattr(module, "__file__", None) or module.__name__


def file_kind(path):
    """How the adapter runs the file, decided from the file before it is imported (its own imports,
    absl or wandb, would fail first): "train_one_step" (it replaces or wraps that function),
    "prepare" (upstream's trainers whose loop is inline in main(): the model accelerate prepares runs
    behind the deferred proxy); any other file is refused in one line (UpstreamUnsupported)."""
    if os.path.basename(path) in UPSTREAM_PREPARE_FILES:
        return "prepare"
    try:
        with open(path) as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return "train_one_step"   # missing or not Python: the loader says which
    if "train_one_step" not in _top_level_names(tree):
        raise UpstreamUnsupported(f"{path} has no function train_one_step, which jagg_patch.upstream replaces: "
                                  f"is it an upstream DanceGRPO trainer? Supported: {SUPPORTED}, and "
                                  f"{', '.join(UPSTREAM_PREPARE_FILES)} (its model prepared by accelerate)")
    return "train_one_step"


def _own_step_release(path, parameters, hashes):
    """The release of UPSTREAM_OWN_STEP_RELEASES this train_one_step is (by token hash, or by file name
    and parameter count), or None."""
    name = os.path.basename(path)
    return next((r for r in UPSTREAM_OWN_STEP_RELEASES
                 if r.token_hash in hashes or (name == r.file and parameters == r.parameters)), None)


def _top_level_names(tree):
    """The names a module's top level binds: functions, classes, imports, assignments."""
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def family_of(module):
    """The trainer family told by train_one_step's parameters, or None where the restated step is
    written for none (family_and_reason says why); a file without train_one_step is refused naming the
    supported ones."""
    return family_and_reason(module)[0]


def family_and_reason(module):
    """(the family, None) or (None, why the restated step is written for no family of it: a release of
    UPSTREAM_OWN_STEP_RELEASES, or parameters of none)."""
    fn = getattr(module, "train_one_step", None)
    if not callable(fn):
        raise UpstreamUnsupported(f"{_file(module)} has no function train_one_step, which jagg_patch.upstream "
                                  f"replaces: is it an upstream DanceGRPO trainer? Supported: {SUPPORTED}")
    try:
        hashes = set(token_hashes(fn))
    except (OSError, TypeError):   # no readable source: told by name and parameters alone
        hashes = set()
    own = _own_step_release(_file(module), len(param_names(fn)), hashes)
    if own is not None:
        return None, own.reason
    params = set(param_names(fn))
    for family, marks in UPSTREAM_FAMILY_PARAMETERS:
        if params.issuperset(marks):
            return family, None
    return None, f"a train_one_step{param_names(fn)} of none of the trainers the adapter restates ({SUPPORTED})"


def _difference(found, expected):
    removed = [p for p in expected if p not in found]
    added = [p for p in found if p not in expected]
    if removed or added:
        return ", ".join(([f"lost {removed}"] if removed else []) + ([f"gained {added}"] if added else []))
    return "same names in another order"


def _nearest_list(found, lists):
    return min(lists, key=lambda expected: len(set(found) ^ set(expected)))


def _literals(fn):
    """The plain string constants of fn's own source (not the pieces of an f-string), in source
    order; empty when the source is not readable."""
    try:
        tree = ast.parse(function_source(fn))
    except (OSError, TypeError, SyntaxError, ValueError):
        return []
    found, todo = [], [tree]
    while todo:
        node = todo.pop(0)
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.append(((node.lineno, node.col_offset), node.value))
        if not isinstance(node, ast.JoinedStr):
            todo.extend(ast.iter_child_nodes(node))
    return [value for _, value in sorted(found, key=lambda item: item[0])]


def reward_names(family):
    """The rewards the family's train_one_step reports, one reward file each, in its order."""
    return UPSTREAM_REWARD_NAMES.get(family, ("reward",))


def reward_files_of(fn):
    """The ./...reward.txt files train_one_step appends mean rewards to, in its order (./reward.txt;
    ./hps_reward.txt before bbf5278; HunyuanVideo's ./vq_reward.txt, ./mq_reward.txt), read from its
    own source; empty if it names none."""
    return tuple(dict.fromkeys(s for s in _literals(fn) if s.endswith("reward.txt")))


def _returned_tuple_sizes(fn):
    """Sizes of the literal tuples fn itself returns (not its nested functions); empty when it returns
    none or its source is not readable."""
    try:
        (definition,) = ast.parse(function_source(fn)).body
    except (OSError, TypeError, SyntaxError, ValueError):
        return set()
    if not isinstance(definition, (ast.FunctionDef, ast.AsyncFunctionDef)):
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
    found, known = param_names(module.train_one_step), UPSTREAM_TRAIN_ONE_STEP[family]
    if found not in known:
        expected = _nearest_list(found, known)
        changes.append(f"train_one_step takes {found}, expected {expected} ({_difference(found, expected)})")
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
    if sizes - {UPSTREAM_ROLLOUT_VALUES[family]}:
        changes.append(f"sample_reference_model returns {sorted(sizes)} values, expected "
                       f"{UPSTREAM_ROLLOUT_VALUES[family]}")
    files, names = reward_files_of(module.train_one_step), reward_names(family)
    if not files:
        changes.append("train_one_step names no ./reward.txt file to append the mean reward to")
    elif len(files) != len(names):
        changes.append(f"train_one_step names the reward files {list(files)}, the {family} trainer reports "
                       f"{len(names)} rewards ({', '.join(names)})")
    return changes


def known_release(fn, family, releases=UPSTREAM_RELEASES):
    """The release of `family` whose train_one_step has fn's token hash (on this Python or on every
    one: see jagg_patch.upstream.tokenhash), or None."""
    hashes = token_hashes(fn)
    return next((r for r in releases if r.family == family and r.token_hash in hashes), None)


def nearest_release(fn, family, releases=UPSTREAM_RELEASES):
    """The known release of the family most like fn: the same parameter list first, then the same
    reward file; the newest among equals (the table lists the newest first)."""
    params, reward_files = param_names(fn), reward_files_of(fn)
    candidates = [r for r in releases if r.family == family]
    if not candidates:
        return None
    return max(candidates, key=lambda r: 2 * (r.parameters == params) + (r.reward_files == reward_files))


def fingerprint(module):
    """Everything the checks compare, as a release is recorded: family, parameter lists, the token
    hash of train_one_step (and the running Python's own where it differs), the reward file, and the
    known release it is (None: unknown)."""
    family = family_of(module)
    fn = module.train_one_step
    release = known_release(fn, family) if family else None
    return {"file": _file(module), "family": family,
            "parameters": {name: param_names(getattr(module, name))
                           for name in ("train_one_step", *UPSTREAM_SEAMS.get(family, {}))
                           if callable(getattr(module, name, None))},
            "token_hash": token_hash(fn), "token_hashes": token_hashes(fn), "reward_files": reward_files_of(fn),
            "known_release": release.commits if release is not None else None}


def describe_fingerprint(found):
    """The fingerprint as printed by --jagg_fingerprint, ending with the line that records it."""
    hashes = found["token_hashes"]
    native = f" (this Python's own tokenization of its f-strings: {hashes[1]})" if len(hashes) > 1 else ""
    lines = [f"file: {found['file']}", f"family: {found['family']}",
             f"train_one_step token hash: {found['token_hash']}{native}",
             f"known release: {found['known_release'] or 'none (see ' + DOCS_SECTION + ')'}",
             f"reward files: {', '.join(found['reward_files']) or 'none'}", "parameters:"]
    lines += [f"  {name}{params}" for name, params in found["parameters"].items()]
    lines += ["to record it, add to jagg_patch.seams.UPSTREAM_RELEASES:",
              f"  UpstreamRelease({found['token_hash']!r}, {found['family']!r}, "
              f"\"{os.path.basename(found['file'])} <commit>\", {found['parameters']['train_one_step']}, "
              f"{found['reward_files']!r}),"]
    return "\n".join(lines)


def rollout_changed(family, count):
    """The message for a sample_reference_model that returned `count` values."""
    return (f"upstream changed sample_reference_model: it returned {count} values, jagg_patch.upstream expects "
            f"{UPSTREAM_ROLLOUT_VALUES[family]} (upstream {UPSTREAM_COMMIT}, {family}); see {DOCS_PAGE}")


def _labels(fn):
    """(the per-sample reward print's label, the gathered rewards' labels in order) as upstream's own
    source has them: "hps reward" before bbf5278, "reward" since; the gathered prints' own constants."""
    literals = _literals(fn)
    reward = "hps reward" if "hps reward" in literals else "reward"
    gathered = tuple(dict.fromkeys(s for s in literals if s.startswith("gathered"))) or ("gathered_reward",)
    return reward, gathered


def check_upstream(module, allow_changes=False, releases=None):
    """Check a loaded upstream trainer module before the first step; returns its Trainer (its
    `unknown` says why the restated step does not run it, where it does not).

    releases: the known releases (default jagg_patch.seams.UPSTREAM_RELEASES)."""
    fn = module.train_one_step if callable(getattr(module, "train_one_step", None)) else None
    family, no_family = family_and_reason(module)
    reward_label, gathered_labels = _labels(fn)
    if family is None:
        return Trainer(None, _file(module), None, reward_files_of(fn), reward_label, gathered_labels, no_family)
    changes = signature_changes(module, family)
    if changes:
        line = (f"upstream changed what jagg_patch.upstream relies on in {_file(module)} ({family}, written "
                f"against upstream {UPSTREAM_COMMIT} and its earlier releases): {'; '.join(changes)}. See {DOCS_PAGE}")
        if not allow_changes:
            raise UpstreamChanged(line + "; --jagg_allow_upstream_changes runs anyway")
        warnings.warn(UpstreamSourceChanged(line + " (running anyway: --jagg_allow_upstream_changes)"), stacklevel=2)
    releases = UPSTREAM_RELEASES if releases is None else releases
    release = known_release(fn, family, releases)
    unknown = None
    if release is None:
        nearest = nearest_release(fn, family, releases)
        near = f"{nearest.commits} (token hash {nearest.token_hash})" if nearest is not None else "none"
        unknown = (f"no release jagg_patch.upstream knows (token hash {' / '.join(token_hashes(fn))}; the nearest "
                   f"known is {family} {near}; see {DOCS_SECTION})")
    return Trainer(family, _file(module), release, reward_files_of(fn) or ("./reward.txt",), reward_label,
                   gathered_labels, unknown)
