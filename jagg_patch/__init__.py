"""JAGG for dancegrpo: a switchable run-time patch of the policy-update seam.

    from jagg_patch import JaggConfig, apply_jagg, revert_jagg
    apply_jagg(window=4, jagg_frac=0.6)   # every trainer in dancegrpo.TRAINERS: the paper's grouping, alpha
                                          # and joint backward, with (exact) on-policy rollout reuse
    apply_jagg(JaggConfig(window=4, jagg_frac=1.0, grouping="window", alpha="index", backward="split"))  # the authors'
    ...
    revert_jagg()

or launch a trainer with it: `python -m jagg_patch dancegrpo.train_grpo_flux --jagg_window 4 ...`.
"""
from .core import (ALPHA_RULES, BACKWARDS, GROUPINGS, MODES, GroupResult, interpolation_weights, jagg_group_backward,
                   validate_jagg_config)
from .config import JaggConfig
from .plan import Group, describe_plan, num_trained_windows, plan_groups, plan_windows
from .patch import apply_jagg, is_patched, revert_jagg
from .seams import SEAMS, SeamError, check_seams
from .update import make_policy_update, make_window_selection

__all__ = ["JaggConfig", "ALPHA_RULES", "BACKWARDS", "GROUPINGS", "MODES", "Group", "GroupResult", "describe_plan",
           "interpolation_weights", "jagg_group_backward", "num_trained_windows", "plan_groups", "plan_windows",
           "validate_jagg_config", "apply_jagg", "is_patched", "make_policy_update", "make_window_selection",
           "revert_jagg", "SEAMS", "SeamError", "check_seams"]
