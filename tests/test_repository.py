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
