"""JAGG on any GRPO loop, left as it is: a proxy that stands where the loop calls its model and
defers the backward (docs/deferred.md).

    from jagg_patch import JaggConfig
    from jagg_patch import deferred
    proxy = deferred.wrap(model, JaggConfig(window=4, jagg_frac=0.6)).attach(optimizer)
    # the loop, unchanged, calling proxy(...) where it called model(...)
    proxy.stats[-1]          # the last flush: rows deferred, trained exactly and why, groups, passes

This package imports torch and the method's own math (jagg_patch.core, .plan, .config) and nothing
of dancegrpo, diffusers or accelerate, so it loads in the environment another codebase already has.
Its names load on first use, so that `python -m jagg_patch.deferred --help` answers before torch.
"""
from ..lazy import lazy_exports

_EXPORTS = {"ARGUMENT_ROLES": ".calls", "ArgumentRoles": ".calls", "DeferredError": ".errors",
            "DeferredModel": ".proxy", "wrap": ".proxy", "FlushStats": ".stats", "IDENTICAL": ".record",
            "MODE_EXACT": ".record", "NO_RECORD": ".record", "ROUTED_EXACT": ".record", "TRAINED_TWICE": ".record"}

__getattr__ = lazy_exports(__name__, _EXPORTS)


__all__ = ["wrap", "DeferredModel", "DeferredError", "FlushStats", "ARGUMENT_ROLES", "ArgumentRoles", "NO_RECORD",
           "IDENTICAL", "TRAINED_TWICE", "ROUTED_EXACT", "MODE_EXACT"]
