"""Loading an upstream trainer file as a module without running its `if __name__ == "__main__":`
block, and running that block later in the module's namespace.

Upstream builds its parser inline in that block and `main(args)` calls `train_one_step` by its
module-global name, so: load the definitions, replace the global, then run the block.
"""
import ast
import os
import sys
import types

_MAIN_BLOCKS = {}   # module name -> the compiled body of its __main__ block(s)


def _is_main_guard(node):
    """`if __name__ == "__main__":` (either operand order)."""
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare) or len(node.test.ops) != 1:
        return False
    sides = [node.test.left, node.test.comparators[0]]
    return (isinstance(node.test.ops[0], ast.Eq)
            and any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides)
            and any(isinstance(s, ast.Constant) and s.value == "__main__" for s in sides))


NAMESPACE_PACKAGE = "fastvideo"   # upstream's package folder, which has no __init__.py


def checkout_root(path):
    """The folder above the file's outermost package: the package folders are those with an
    __init__.py and upstream's `fastvideo/`, a namespace package without one (so the root of
    <root>/fastvideo/train_grpo_flux.py is <root>, installed or not)."""
    folder = os.path.dirname(os.path.realpath(path))
    while os.path.isfile(os.path.join(folder, "__init__.py")) or os.path.basename(folder) == NAMESPACE_PACKAGE:
        folder = os.path.dirname(folder)
    return folder


def module_name(path, root):
    """The dotted name the file has below `root` (fastvideo.train_grpo_flux)."""
    relative = os.path.splitext(os.path.relpath(os.path.realpath(path), root))[0]
    return relative.replace(os.sep, ".")


def _put_first_on_path(*folders):
    """The folders at the front of sys.path, in this order, so that they win over any other
    checkout (installed, or on PYTHONPATH) for the same package names."""
    for folder in reversed(folders):
        while folder in sys.path:
            sys.path.remove(folder)
        sys.path.insert(0, folder)


def _loaded_from(module):
    files = [getattr(module, "__file__", None), *list(getattr(module, "__path__", []) or [])]
    return [os.path.abspath(f) for f in files if f]


def _forget_other_checkout(package, root):
    """Drop `package` and its submodules from sys.modules where they were imported from outside
    `root`: the file given decides which checkout its `fastvideo.*` imports come from."""
    inside = os.path.join(os.path.abspath(root), "")
    stale = [name for name, module in list(sys.modules.items())
             if (name == package or name.startswith(package + ".")) and module is not None
             and any(not f.startswith(inside) for f in _loaded_from(module))]
    for name in stale:
        del sys.modules[name]
    return stale


def load_trainer(path):
    """The file's definitions as a module (registered under its dotted name, so that pickling and
    `import fastvideo.<name>` find it); its __main__ block is kept, not run. The script's folder and
    the checkout root go first on sys.path, as when upstream runs the file from its checkout: its
    `fastvideo.*` imports come from that checkout, whichever other one is installed. A symbolic link
    is followed: the file's real location decides the checkout."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"upstream trainer file {os.path.abspath(path)!r} does not exist; give the path "
                                "of e.g. fastvideo/train_grpo_flux.py in your DanceGRPO checkout")
    path = os.path.realpath(path)
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    definitions = [node for node in tree.body if not _is_main_guard(node)]
    blocks = [stmt for node in tree.body if _is_main_guard(node) for stmt in node.body]
    root = checkout_root(path)
    _put_first_on_path(os.path.dirname(path), root)
    name = module_name(path, root)
    if "." in name:
        _forget_other_checkout(name.split(".")[0], root)
    module = types.ModuleType(name)
    module.__file__ = path
    sys.modules[name] = module
    try:
        exec(compile(ast.Module(definitions, type_ignores=[]), path, "exec"), module.__dict__)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    _MAIN_BLOCKS[name] = compile(ast.Module(blocks, type_ignores=[]), path, "exec") if blocks else None
    return module


def has_main_block(module):
    return _MAIN_BLOCKS.get(module.__name__) is not None


def run_main_block(module, argv):
    """Run the file's __main__ block in the module's namespace with sys.argv = [file, *argv]."""
    code = _MAIN_BLOCKS.get(module.__name__)
    if code is None:
        raise RuntimeError(f"{module.__file__} has no `if __name__ == \"__main__\":` block to run")
    saved = sys.argv
    sys.argv = [module.__file__, *argv]
    try:
        exec(code, module.__dict__)
    finally:
        sys.argv = saved
