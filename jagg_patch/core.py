"""JAGG: Jacobian-Aggregated Group Gradient (see ../shared/JAGG.md for the method).

Model-agnostic pieces: the interpolation weights, the backward of one group of
W consecutive trained transitions, and the plan that routes groups to JAGG or
to the exact per-step backward. Nothing here knows about dancegrpo.
"""
from dataclasses import dataclass
from fractions import Fraction
import math

import torch

MODES = ("jagg", "endpoints", "exact")


def interpolation_weights(t):
    """alpha_j = (t_0 - t_j) / (t_0 - t_{W-1}), in float64.

    `t` is [W] (one group) or [W, m] (one group per sample, member j of sample i
    at t[j, i]); the result has the same shape.
    """
    t = torch.as_tensor(t, dtype=torch.float64)
    if t.ndim not in (1, 2) or t.shape[0] < 2:
        raise ValueError(f"interpolation_weights needs W >= 2 timesteps as [W] or [W, m], got shape {tuple(t.shape)}")
    span = t[0] - t[-1]
    if bool((span == 0).any()):
        raise ValueError("interpolation_weights: t_0 == t_{W-1}, the group has no extent in t to interpolate over")
    return (t[0] - t) / span


@dataclass
class GroupResult:
    loss: float = 0.0          # sum of the member losses
    forwards_grad: int = 0     # predict() calls that built a graph
    forwards_nograd: int = 0
    backward_calls: int = 0    # autograd backward invocations


def _validate_mode(mode):
    if mode not in MODES:
        raise ValueError(f"JAGG mode must be one of {MODES}, got {mode!r}")


def _upstream_grad(step_loss, j, v):
    """Phase 2: L_j at a detached proxy of v and dL_j/dv; only the light loss graph is built."""
    proxy = v.detach().requires_grad_(True)
    with torch.enable_grad():
        loss = step_loss(j, proxy)
        (grad,) = torch.autograd.grad(loss, proxy, allow_unused=True)
    return loss.detach(), (torch.zeros_like(proxy) if grad is None else grad)


def _broadcast_alpha(alpha_j, like):
    """alpha_j is a scalar (shared t) or [m] (per-sample t) -> broadcastable to v [m, ...]."""
    if alpha_j.ndim == 1:
        alpha_j = alpha_j.reshape(-1, *([1] * (like.ndim - 1)))
    return alpha_j.to(device=like.device, dtype=like.dtype)


def _exact_group(predict, step_loss, width):
    result = GroupResult()
    for j in range(width):
        loss = step_loss(j, predict(j))
        loss.backward()
        result.loss += loss.item()
        result.forwards_grad += 1
        result.backward_calls += 1
    return result


def _endpoint_weights(alpha, mode, width):
    """Per-member (weight on J_0, weight on J_{W-1}) for the joint backward.

    jagg: J_j ~ (1 - alpha_j) J_0 + alpha_j J_{W-1}  (phase 3).
    endpoints (the paper's ablation): the middle members' gradient signal is dropped and
    each endpoint carries its OWN loss with weight W/2, so the group still weighs W members:
        g = (W/2) (J_0^T s_0 + J_{W-1}^T s_{W-1})  = grad of (W/2) (L_0(v_0) + L_{W-1}(v_{W-1})).
    """
    if mode == "jagg":
        return [(1 - a, a) for a in alpha]
    half = width / 2.0
    zero = torch.zeros_like(alpha[0])
    weights = [(zero, zero)] * width
    weights[0], weights[-1] = (zero + half, zero), (zero, zero + half)
    return weights


def jagg_group_backward(predict, step_loss, t, mode="jagg"):
    """Accumulate one group's gradient into the parameters `predict` reaches.

    predict(j) -> v_j (model output of member j); step_loss(j, v) -> scalar loss of
    member j (no model pass); t: the W model timesteps in denoising order, [W] or [W, m].
    mode "jagg": 2 forwards with grad + W-2 without, ONE autograd.backward on the two
    endpoint outputs. "endpoints": same passes, ablation weights (see _endpoint_weights).
    "exact": forward with grad + backward for every member.
    """
    _validate_mode(mode)
    width = len(t)
    if mode == "exact" or width == 1:
        return _exact_group(predict, step_loss, width)
    alpha = interpolation_weights(t)
    result = GroupResult()
    ends, upstream = {}, []
    for j in range(width):
        if j in (0, width - 1):
            v = predict(j)
            ends[j] = v
            result.forwards_grad += 1
        else:
            with torch.no_grad():  # the point of JAGG: no graph, no activations for middles
                v = predict(j)
            result.forwards_nograd += 1
        loss, grad = _upstream_grad(step_loss, j, v)
        result.loss += loss.item()
        upstream.append(grad)
    s_base = s_corr = None
    for (w0, w1), s in zip(_endpoint_weights(alpha, mode, width), upstream):
        w0, w1 = _broadcast_alpha(w0, s), _broadcast_alpha(w1, s)
        s_base = w0 * s if s_base is None else s_base + w0 * s
        s_corr = w1 * s if s_corr is None else s_corr + w1 * s
    # One call for both endpoint graphs: under FSDP one all-gather per module per group.
    torch.autograd.backward([ends[0], ends[width - 1]], [s_base, s_corr])
    result.backward_calls += 1
    return result


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


def validate_jagg_config(window, jagg_frac, mode="jagg"):
    """Raise ValueError naming the fix for a bad window / fraction / mode."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 2:
        raise ValueError(f"JAGG window must be an integer >= 2 (a group needs two endpoints), got {window!r}; "
                         "for the exact per-step backward use jagg_frac 0 or mode 'exact'")
    if isinstance(jagg_frac, bool) or not isinstance(jagg_frac, (int, float)) or not 0.0 <= jagg_frac <= 1.0:
        raise ValueError(f"jagg_frac must be a number in [0, 1], got {jagg_frac!r}")
    _validate_mode(mode)


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


def describe_plan(groups, mode="jagg"):
    """Human-readable plan: one line per group, and the backward count it implies."""
    lines, backwards, vanilla = [], 0, 0
    for g in groups:
        jagg = g.jagg and mode != "exact"
        kind = f"JAGG ({mode})" if jagg else "exact"
        cost = (f"2 grad + {g.size - 2} no-grad forwards, 2 backwards in 1 call" if jagg
                else f"{g.size} grad forwards, {g.size} backwards")
        lines.append(f"  group {g.index}: positions {list(g.members)} (size {g.size}) -> {kind}: {cost}")
        backwards += 2 if jagg else g.size
        vanilla += g.size
    lines.append(f"  per sample: {backwards} transformer backwards instead of {vanilla}")
    return "\n".join(lines)
