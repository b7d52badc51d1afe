"""The settings JAGG offers (modes, alpha rules, backward forms, groupings, rollout reuse) and their
checks, without torch: the command line is built from them, and --help and a flag error answer
before torch loads. jagg_patch.core re-exports them beside the group backward that uses them."""
import os

MODES = ("jagg", "endpoints", "exact")
ALPHA_RULES = ("timestep", "index")   # the paper's text | the authors' code
# joint: one autograd call on both endpoints' graphs | split: one endpoint graph at a time |
# batched: both endpoints in ONE forward (a batch of 2m) and one backward of that single graph
BACKWARDS = ("joint", "split", "batched")
# auto: batched on several ranks (FSDP gathers each unit once for both endpoints' forward and once
# for their backward, holding one unit at a time), split on one (nothing to communicate; the
# activations of one endpoint graph at a time).
BACKWARD_CHOICES = BACKWARDS + ("auto",)
GROUPINGS = ("trained", "window")     # consecutive trained transitions | contiguous trajectory windows
# Middle members' outputs taken from the rollout: never | before the step's first optimizer step
# (exact) | also after it (an approximation: stale outputs)
REUSE_MODES = ("off", "on_policy", "always")


def resolve_backward(backward, world_size=None):
    """The backward form `auto` stands for with `world_size` ranks (default: this process group's,
    or torchrun's WORLD_SIZE before it exists); joint and split stand for themselves."""
    if backward != "auto":
        return backward
    if world_size is None:
        import torch.distributed as dist
        world_size = (dist.get_world_size() if dist.is_available() and dist.is_initialized()
                      else int(os.environ.get("WORLD_SIZE", "1")))
    return "batched" if world_size > 1 else "split"


def _check_choice(kind, value, choices):
    if value not in choices:
        raise ValueError(f"JAGG {kind} must be one of {choices}, got {value!r}")


def validate_jagg_config(window, jagg_frac, mode="jagg", alpha="timestep", backward="joint", grouping="trained",
                         reuse="off"):
    """Raise ValueError naming the fix for a bad window / fraction / mode / alpha / backward / grouping / reuse."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 2:
        raise ValueError(f"JAGG window must be an integer >= 2 (a group needs two endpoints), got {window!r}; "
                         "for the exact per-step backward use jagg_frac 0 or mode 'exact'")
    if jagg_frac == "auto":   # routed by the monitor's cosines (jagg_patch.routing)
        pass
    elif isinstance(jagg_frac, bool) or not isinstance(jagg_frac, (int, float)) or not 0.0 <= jagg_frac <= 1.0:
        raise ValueError(f"jagg_frac must be a number in [0, 1] or 'auto', got {jagg_frac!r}")
    for kind, value, choices in (("mode", mode, MODES), ("alpha rule", alpha, ALPHA_RULES),
                                 ("backward", backward, BACKWARD_CHOICES), ("grouping", grouping, GROUPINGS),
                                 ("rollout reuse", reuse, REUSE_MODES)):
        _check_choice(kind, value, choices)
