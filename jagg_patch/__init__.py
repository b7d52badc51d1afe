"""JAGG for dancegrpo: a switchable run-time patch of the policy-update seam.

    from jagg_patch import JaggConfig, apply_jagg, revert_jagg
    apply_jagg(window=4, jagg_frac=0.6)   # every trainer in dancegrpo.TRAINERS: the paper's grouping, alpha
                                          # and joint backward, with (exact) on-policy rollout reuse
    apply_jagg(JaggConfig(window=4, jagg_frac=1.0, grouping="window", alpha="index", backward="split"))  # the authors'
    ...
    revert_jagg()

or launch a trainer with it: `python -m jagg_patch dancegrpo.train_grpo_flux --jagg_window 4 ...`.
Any other GRPO loop, unedited: `jagg_patch.deferred.wrap(model, config)` (that package imports
nothing of dancegrpo, nor does this file: it loads in another codebase's environment).
"""
from .lazy import lazy_exports

# Loaded on first use (the group backward needs torch): `python -m jagg_patch ... --help` and the
# tools' flag errors answer before torch loads.
_EXPORTS = {
    "ALPHA_RULES": ".core", "BACKWARDS": ".core", "GROUPINGS": ".core", "MODES": ".core",
    "GroupResult": ".core", "interpolation_weights": ".core", "jagg_group_backward": ".core",
    "validate_jagg_config": ".core", "JaggConfig": ".config", "Group": ".plan", "describe_plan": ".plan",
    "num_trained_windows": ".plan", "plan_groups": ".plan", "plan_windows": ".plan", "apply_jagg": ".patch",
    "apply_deferred": ".patch", "is_patched": ".patch", "revert_jagg": ".patch", "SEAMS": ".seams", "SeamError": ".seams",
    "check_seams": ".seams", "make_policy_update": ".update", "make_window_selection": ".update"
}

__getattr__ = lazy_exports(__name__, _EXPORTS)


__all__ = ["JaggConfig", "ALPHA_RULES", "BACKWARDS", "GROUPINGS", "MODES", "Group", "GroupResult", "describe_plan",
           "interpolation_weights", "jagg_group_backward", "num_trained_windows", "plan_groups", "plan_windows",
           "validate_jagg_config", "apply_jagg", "apply_deferred", "is_patched", "make_policy_update", "make_window_selection",
           "revert_jagg", "SEAMS", "SeamError", "check_seams"]
