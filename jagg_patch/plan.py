"""Which trained transitions go through JAGG: the groups (the paper's consecutive trained
transitions, or the authors' contiguous windows), their routing by jagg_frac, and what each
group costs in forwards and backwards."""
import math
from dataclasses import dataclass
from fractions import Fraction

from .settings import validate_jagg_config


@dataclass(frozen=True)
class Group:
    index: int
    members: tuple   # items of the trained transitions, in denoising order
    jagg: bool       # routed to JAGG (else exact per-step backward)

    @property
    def size(self):
        return len(self.members)


def _round_half_up(x):
    return math.floor(x + Fraction(1, 2))


def plan_groups(trained_steps, window, jagg_frac):
    """Split a sample's trained transitions (denoising order) into consecutive groups of
    `window` (the last one may be shorter); the first round_half_up(n_groups * jagg_frac)
    groups, the highest-noise ones where J is most linear, go to JAGG; a group of 1 is exact."""
    validate_jagg_config(window, jagg_frac)
    steps = [int(s) for s in trained_steps]
    if not steps:
        raise ValueError("plan_groups: no trained transitions")
    if any(b <= a for a, b in zip(steps, steps[1:])):
        raise ValueError(f"plan_groups: trained transitions must be strictly increasing (denoising order), got {steps}")
    chunks = [tuple(steps[i:i + window]) for i in range(0, len(steps), window)]
    n_jagg = _round_half_up(len(chunks) * Fraction(str(float(jagg_frac))))
    return [Group(i, c, jagg=i < n_jagg and len(c) >= 2) for i, c in enumerate(chunks)]


def plan_windows(num_transitions, window, jagg_frac):
    """The authors' grouping: the trainable transitions 0..num_transitions-1 cut into contiguous
    windows (window g = transitions gW .. gW+W-1; the last is shorter when W does not divide
    num_transitions), routed as plan_groups routes groups."""
    if window > num_transitions:
        raise ValueError(f"window grouping needs JAGG window <= S-1 = {num_transitions} trainable transitions, "
                         f"got {window}; lower --jagg_window or raise --sampling_steps")
    return plan_groups(range(num_transitions), window, jagg_frac)


def num_trained_windows(num_windows, timestep_fraction):
    """Windows trained per sample: max(1, int(n_windows * timestep_fraction)), as the authors."""
    return max(1, int(num_windows * timestep_fraction))


def group_cost(group, mode="jagg", reused=False):
    """(grad forwards, no-grad forwards, backwards) of one group per sample; reused: the middle
    members' outputs come from the rollout (no forward at all)."""
    if group.jagg and mode != "exact":
        return 2, 0 if reused else group.size - 2, 2
    return group.size, 0, group.size


def describe_plan(groups, mode="jagg", backward="joint", label="group", key="positions"):
    """Human-readable plan: one line per group, and the backward count it implies."""
    calls = {"split": "2 calls", "deferred": "the flush's replay"}.get(backward, "1 call")
    lines = []
    for g in groups:
        if g.jagg and mode != "exact":
            kind = f"JAGG ({mode}, {backward} backward): 2 grad + {g.size - 2} no-grad forwards, 2 backwards in {calls}"
        else:
            kind = f"exact: {g.size} grad forwards, {g.size} backwards"
        lines.append(f"  {label} {g.index}: {key} {list(g.members)} (size {g.size}) -> {kind}")
    return lines
