"""Rules of the repository itself that code review would otherwise have to catch."""
import ast
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_no_test_module_imports_another():
    """Shared test code lives in conftest.py fixtures or tests/helpers.py (and the toy modules)."""
    offenders = []
    for path in glob.glob(os.path.join(ROOT, "tests", "*.py")):
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            offenders += [(os.path.basename(path), n) for n in names if n.startswith("test_") or n == "conftest"]
    assert not offenders


def test_code_and_docs_speak_of_the_repository_alone():
    """No path outside the repository and no issue numbers in code, scripts, help or docs."""
    files = [p for pattern in ("dancegrpo/**/*.py", "jagg_patch/**/*.py", "tests/**/*.py", "scripts/*", "*.sh",
                               "benchmarks/*", "*.md", "docs/*")
             for p in glob.glob(os.path.join(ROOT, pattern), recursive=True) if os.path.isfile(p)]
    assert len(files) > 50
    pattern = re.compile(r"\.\./shared|\bissues? \d+\b", re.IGNORECASE)
    found = []
    for path in files:
        if path == os.path.abspath(__file__):
            continue
        with open(path, errors="replace") as f:
            found += [f"{os.path.relpath(path, ROOT)}:{i}" for i, line in enumerate(f, 1) if pattern.search(line)]
    assert not found, found


def test_the_suite_runs_with_and_without_workers(request):
    """Without pytest-xdist (`-p no:xdist`) the suite starts (no xdist-only option in pyproject's addopts);
    under it (`-n 2`), work units stay whole (tests/conftest.py sets --dist loadgroup)."""
    import subprocess
    import sys
    if hasattr(request.config, "workerinput"):   # the worker names the units for the controller's loadgroup
        assert request.config.option.loadgroup is True
    # --noconftest: the conftest's imports (torch) are not what is tested; pyproject's options are
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "--noconftest",
                          "-q", "tests/test_repository.py::test_no_test_module_imports_another"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout[-2000:] + run.stderr[-2000:]


def _room(module):
    """dancegrpo.utils.samples -> 'utils'; dancegrpo.trainer -> 'trainer'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _rooms_imported(path, module):
    """The dancegrpo rooms a file imports, at its top or inside a function."""
    tree = ast.parse(open(path).read())
    package = module.rsplit(".", 1)[0] if not path.endswith("__init__.py") else module
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
                targets = [target] if node.module else [f"{target}.{a.name}" for a in node.names]
            else:
                targets = [node.module or ""]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        found |= {_room(t) for t in targets if t.startswith("dancegrpo.")}
    return found - {None}


def test_dancegrpo_rooms_depend_one_way():
    """No two of dancegrpo's rooms (its top-level modules and sub-packages) import each other, directly
    or around a loop, in any function: each room stands above everything it uses, so a reader can
    take the package floor by floor (a loop found names its rooms)."""
    root = os.path.join(ROOT, "dancegrpo")
    edges = {}
    for folder, _, files in os.walk(root):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            module = os.path.relpath(path[:-3], ROOT).replace(os.sep, ".").removesuffix(".__init__")
            room = _room(module)
            if room is None:
                continue
            edges.setdefault(room, set()).update(_rooms_imported(path, module) - {room})

    def loop_from(start, at, seen):
        for nxt in sorted(edges.get(at, ())):
            if nxt == start:
                return [at, nxt]
            if nxt not in seen:
                seen.add(nxt)
                rest = loop_from(start, nxt, seen)
                if rest:
                    return [at] + rest
        return None
    loops = [loop for room in sorted(edges) if (loop := loop_from(room, room, {room}))]
    assert not loops, f"rooms importing each other: {loops[0]}"
