"""Package names that load on first use (PEP 562), for jagg_patch and jagg_patch.deferred: their
command lines answer --help before torch loads. dancegrpo.utils.lazy does the same for dancegrpo; this
one stands apart because these packages load without dancegrpo (in another codebase's environment)."""
import importlib
import sys


def lazy_exports(package, exports):
    """A module-level __getattr__ for `package`: exports maps a name to the submodule defining it."""
    def __getattr__(name):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name], package), name)
        setattr(sys.modules[package], name, value)   # resolved once
        return value
    return __getattr__
