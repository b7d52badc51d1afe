"""The jagg_patch tools prepare their update through the trainer's own seam (trainer.prepare_update),
so they train what the loop trains: under --sde_window_size, only each sample's SDE window (the
ODE transitions around it store log-prob 0 and are never trained)."""
import functools

import pytest

from dancegrpo import trainer
from dancegrpo.algo import objective

WINDOW = ["--sde_window_size", 2, "--sde_window_range", 1, 5]
SMALL = ["--train_batch_size", 1, "--num_generations", 4, "--gradient_accumulation_steps", 4,
         "--sample_batch_size", 2, "--update_batch_size", 2]


@pytest.fixture
def trained(monkeypatch):
    """(window start, transitions) of every micro-batch row handed to the policy update."""
    seen, original = [], trainer.make_update_batch

    @functools.wraps(original)   # the seam check reads the signature
    def spying(ctx, rollout, cond, advantages, sample_idx, steps, *rest, **kw):
        for row, sample in enumerate(sample_idx.tolist()):
            seen.append((int(rollout.window_start[sample]), [k for k in steps[row].tolist() if k >= 0]))
        return original(ctx, rollout, cond, advantages, sample_idx, steps, *rest, **kw)
    monkeypatch.setattr(trainer, "make_update_batch", spying)     # the tools call it from here,
    monkeypatch.setattr(objective, "make_update_batch", spying)   # the update loop from its home
    return seen


def tool_argv(cache_dir, tmp_path, *extra):
    return ["dancegrpo.train_grpo_flux", "--preset", "tiny", "--cache_dir", cache_dir, "--output_dir",
            str(tmp_path), *map(str, SMALL + WINDOW), *map(str, extra)]


@pytest.mark.parametrize("tool, extra", [
    ("diagnostics", ["--jagg_window", 2, "--diag_samples", 2]),
    ("staleness", ["--stale_steps", 0, "--jagg_window", 2]),
    ("backward_profile", ["--prof_reps", 1])])
def test_tools_train_only_the_sde_window(tool, extra, cache_dir, tmp_path, trained):
    import importlib
    importlib.import_module(f"jagg_patch.tools.{tool}").main(tool_argv(cache_dir, tmp_path, *extra))
    assert trained
    for start, steps in trained:
        assert steps and all(start <= k < start + 2 for k in steps), (start, steps)


def dancegrpo_names_used_by(package_dir):
    """(module, name) of every dancegrpo name the package's sources import or reach as module.name."""
    import ast
    import glob
    import importlib
    import os
    uses = set()
    for path in glob.glob(os.path.join(package_dir, "**", "*.py"), recursive=True):
        with open(path) as f:
            tree = ast.parse(f.read())
        modules = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dancegrpo"):
                for alias in node.names:
                    try:
                        modules[alias.asname or alias.name] = importlib.import_module(f"{node.module}.{alias.name}")
                    except ImportError:
                        uses.add((node.module, alias.name))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
                uses.add((modules[node.value.id].__name__, node.attr))
    return uses


def test_seams_list_everything_jagg_patch_uses_of_dancegrpo():
    import os
    import jagg_patch
    from jagg_patch.seams import DANCEGRPO_USES
    used = dancegrpo_names_used_by(os.path.dirname(jagg_patch.__file__))
    assert ("dancegrpo.trainer", "prepare_update") in used   # the scan sees the tools
    assert used <= {(m, n) for m, n, _ in DANCEGRPO_USES}, used - {(m, n) for m, n, _ in DANCEGRPO_USES}


def test_check_seams_names_a_changed_tool_seam(monkeypatch):
    from jagg_patch import SeamError, check_seams
    monkeypatch.setattr(trainer, "prepare_update", lambda ctx, step=None: None)
    with pytest.raises(SeamError, match="dancegrpo.trainer.prepare_update takes"):
        check_seams("dancegrpo.train_grpo_flux")
    monkeypatch.delattr(trainer, "prepare_update")
    with pytest.raises(SeamError, match="dancegrpo.trainer has no 'prepare_update'"):
        check_seams("dancegrpo.train_grpo_flux")


def test_the_tools_read_only_the_listed_fields_of_the_trainers_context():
    """Every `ctx.<name>` in jagg_patch (outside the upstream adapter, whose ctx is not dancegrpo's) is a
    field listed in TRAIN_CONTEXT_FIELDS or a property of TrainContext."""
    import ast
    import glob
    import os
    import jagg_patch
    from dancegrpo.build import TrainContext
    from jagg_patch.seams import TRAIN_CONTEXT_FIELDS
    allowed = set(TRAIN_CONTEXT_FIELDS) | {n for n, v in vars(TrainContext).items() if isinstance(v, property)}
    read = set()
    for path in glob.glob(os.path.join(os.path.dirname(jagg_patch.__file__), "**", "*.py"), recursive=True):
        if os.sep + "upstream" + os.sep in path:
            continue
        with open(path) as f:
            tree = ast.parse(f.read())
        read |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                 and isinstance(node.value, ast.Name) and node.value.id == "ctx"}
    assert "num_params" in read   # the scan sees the tools
    assert read <= allowed, read - allowed
