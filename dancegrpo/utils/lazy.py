"""Package exports that load on first use (PEP 562). The command line imports these packages to
build its parser, and answers --help and a flag error before torch and diffusers load (about 2 s
and 4 s on a 2-core machine); the code that runs afterwards gets the same names, loaded then."""
import importlib
import sys


def lazy_exports(package, exports):
    """A module-level __getattr__ for `package`: exports maps a name to the submodule defining it
    (".model"), or to (submodule, its name there) for an alias."""
    def __getattr__(name):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        where = exports[name]
        submodule, attribute = where if isinstance(where, tuple) else (where, name)
        value = getattr(importlib.import_module(submodule, package), attribute)
        setattr(sys.modules[package], name, value)   # resolved once
        return value
    return __getattr__
