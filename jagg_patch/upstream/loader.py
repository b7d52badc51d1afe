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


def checkout_root(path):
    """The folder above the file's outermost package (the checkout root for fastvideo/train_*.py)."""
    folder = os.path.dirname(os.path.abspath(path))
    while os.path.isfile(os.path.join(folder, "__init__.py")):
        folder = os.path.dirname(folder)
    return folder


def module_name(path, root):
    """The dotted name the file has below `root` (fastvideo.train_grpo_flux)."""
    relative = os.path.splitext(os.path.relpath(os.path.abspath(path), root))[0]
    return relative.replace(os.sep, ".")


def _put_on_path(*folders):
    for folder in reversed(folders):
        if folder not in sys.path:
            sys.path.insert(0, folder)


def load_trainer(path):
    """The file's definitions as a module (registered under its dotted name, so that pickling and
    `import fastvideo.<name>` find it); its __main__ block is kept, not run. The script's folder and
    the checkout root go on sys.path, as when upstream runs the file itself."""
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"upstream trainer file {path!r} does not exist; give the path of e.g. "
                                "fastvideo/train_grpo_flux.py in your DanceGRPO checkout")
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    definitions = [node for node in tree.body if not _is_main_guard(node)]
    blocks = [stmt for node in tree.body if _is_main_guard(node) for stmt in node.body]
    root = checkout_root(path)
    _put_on_path(os.path.dirname(path), root)
    name = module_name(path, root)
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
