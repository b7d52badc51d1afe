"""JAGG on an unmodified upstream DanceGRPO checkout (fastvideo/train_grpo_*.py).

    from jagg_patch.upstream import load_trainer, apply, revert
    module = load_trainer("fastvideo/train_grpo_flux.py")   # definitions; the __main__ block not run
    apply(module, window=4, jagg_frac=0.6)                    # replaces module.train_one_step
    ...                                                       # module.train_one_step.last_stats: counts
    revert(module)

or from the checkout: `torchrun ... -m jagg_patch.upstream --jagg_window 4 fastvideo/train_grpo_flux.py
<upstream flags>`. Only train_one_step is replaced; upstream's rollout, log-prob and everything else
run as they are (see jagg_patch.upstream.step), and what the adapter relies on is checked first
(jagg_patch.upstream.fingerprint against jagg_patch.seams.UPSTREAM_SEAMS).
"""
from dancegrpo.utils.lazy import lazy_exports

from .fingerprint import (UpstreamChanged, UpstreamSourceChanged, UpstreamUnsupported, check_upstream, fingerprint,
                          known_release)
from .loader import load_trainer, run_main_block
from .tokenhash import token_hash

# The patch (the update: torch) loads on first use: `python -m jagg_patch.upstream --help` and its flag
# errors answer before torch loads.
__getattr__ = lazy_exports(__name__, {"apply": ".patch", "is_applied": ".patch", "revert": ".patch"})

__all__ = ["load_trainer", "run_main_block", "apply", "revert", "is_applied", "check_upstream", "fingerprint",
           "known_release", "token_hash", "UpstreamChanged", "UpstreamSourceChanged", "UpstreamUnsupported"]
