"""JAGG: Jacobian-Aggregated Group Gradient (arXiv 2607.17572; docs/jagg.md).

Model-agnostic pieces: the interpolation weights, the backward of one group of
W consecutive trained transitions, and the checks of a setting (the groups and
their routing are jagg_patch.plan's, the update that runs them jagg_patch.update's).
Nothing here knows about dancegrpo.
"""
from dataclasses import dataclass

import torch

from .settings import (ALPHA_RULES, BACKWARD_CHOICES, BACKWARDS, GROUPINGS, MODES, REUSE_MODES,  # noqa: F401
                       _check_choice, resolve_backward, validate_jagg_config)


def interpolation_weights(t, rule="timestep"):
    """alpha_j of the members of a group, in float64.

    rule "timestep" (the paper): alpha_j = (t_0 - t_j) / (t_0 - t_{W-1});
    rule "index" (the authors' code): alpha_j = j / (W-1), whatever t is.
    `t` is [W] (one group) or [W, m] (one group per sample, member j of sample i
    at t[j, i]); the result has the same shape. alpha_0 = 0 and alpha_{W-1} = 1 exactly.
    """
    _check_choice("alpha rule", rule, ALPHA_RULES)
    t = torch.as_tensor(t, dtype=torch.float64)
    if t.ndim not in (1, 2) or t.shape[0] < 2:
        raise ValueError(f"interpolation_weights needs W >= 2 timesteps as [W] or [W, m], got shape {tuple(t.shape)}")
    if rule == "index":
        index = torch.arange(t.shape[0], dtype=torch.float64) / (t.shape[0] - 1)
        return index.reshape(-1, *([1] * (t.ndim - 1))).expand_as(t).clone()
    span = t[0] - t[-1]
    if bool((span == 0).any()):
        raise ValueError("interpolation_weights: t_0 == t_{W-1}, the group has no extent in t to interpolate over")
    return (t[0] - t) / span


@dataclass
class GroupResult:
    loss: float = 0.0          # sum of the member losses
    forwards_grad: int = 0     # predict() calls that built a graph
    forwards_nograd: int = 0
    forwards_reused: int = 0   # middle members whose output came from `reuse` instead of predict()
    backward_calls: int = 0    # autograd backward invocations


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


def fold_signals(weights, upstream, end):
    """s_base (end 0) or s_corr (end 1): the weighted sum of the upstream gradients known so far.

    The sum is taken in float32 at least and rounded once to the gradients' own dtype: under bf16
    autocast s_j is bf16 (the model output's dtype, as upstream's flux_step gives it, and what vanilla
    backpropagates), and a bf16 fold would round alpha and every partial sum to 8 bits as well."""
    first = next(iter(upstream.values()))
    wide = first.dtype if first.dtype in (torch.float32, torch.float64) else torch.float32
    total = sum(_broadcast_alpha(weights[j][end], s.to(wide)) * s.to(wide) for j, s in upstream.items())
    return total.to(first.dtype)


def _exact_group(predict, step_loss, width, run_backward):
    result = GroupResult()
    for j in range(width):
        loss = step_loss(j, predict(j))
        run_backward([loss])
        result.loss += loss.item()
        result.forwards_grad += 1
        result.backward_calls += 1
    return result


def endpoint_weights(alpha, mode, width):
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


def jagg_group_backward(predict, step_loss, t, mode="jagg", alpha="timestep", backward="joint",
                        run_backward=None, reuse=None, predict_pair=None):
    """Accumulate one group's gradient into the parameters `predict` reaches.

    predict(j) -> v_j (model output of member j); step_loss(j, v) -> scalar loss of
    member j (no model pass); t: the W model timesteps in denoising order, [W] or [W, m].
    mode "jagg": the endpoints' signals are the alpha-weighted sums of all members' upstream
    gradients (alpha: see interpolation_weights); "endpoints": the paper's ablation (see
    endpoint_weights); both run 2 forwards with grad + W-2 without and 2 backwards:
      backward "joint": ONE autograd.backward on both endpoint outputs (both graphs alive);
      backward "split": middles first, then each endpoint's forward with grad and at once its
        own backward, so one endpoint graph is alive at a time (the authors' form).
    "exact": forward with grad + backward for every member.
    run_backward(outputs, grads): an engine's equivalent of torch.autograd.backward (one call =
    one backward pass); None: torch.autograd.backward, looked up at call time.
    reuse(j) -> v_j already computed elsewhere (the rollout's forward), used instead of a middle
    member's no-grad forward; None: every middle member is forwarded. Middles need no graph, so
    any v_j equal to predict(j) gives the same gradient.
    predict_pair(i, j) -> (v_i, v_j) from ONE model call; needed by backward "batched" (middles
    first, then both endpoints in one forward with grad and one backward of that graph: the
    parameters' gradient comes out of one pass per layer, nothing to sum across graphs).
    """
    run_backward = run_backward or torch.autograd.backward
    _check_choice("mode", mode, MODES)
    _check_choice("alpha rule", alpha, ALPHA_RULES)
    _check_choice("backward", backward, BACKWARDS)
    width = len(t)
    if mode == "exact" or width == 1:
        return _exact_group(predict, step_loss, width, run_backward)
    weights = endpoint_weights(interpolation_weights(t, alpha), mode, width)
    result, upstream = GroupResult(), {}

    def forward(j):
        if j in (0, width - 1):
            v = predict(j)
            result.forwards_grad += 1
        elif reuse is not None:
            v = reuse(j).detach()
            result.forwards_reused += 1
        else:
            with torch.no_grad():  # the point of JAGG: no graph, no activations for middles
                v = predict(j)
            result.forwards_nograd += 1
        loss, upstream[j] = _upstream_grad(step_loss, j, v)
        result.loss += loss.item()
        return v

    def signal(end):
        return fold_signals(weights, upstream, end)

    if backward == "batched":
        if predict_pair is None:
            raise ValueError("JAGG backward 'batched' needs predict_pair (one model call for both endpoints)")
        for j in range(1, width - 1):
            forward(j)
        ends = predict_pair(0, width - 1)
        result.forwards_grad += 2
        for j, v in zip((0, width - 1), ends):
            loss, upstream[j] = _upstream_grad(step_loss, j, v)
            result.loss += loss.item()
        run_backward(list(ends), [signal(0), signal(1)])
        result.backward_calls += 1
        return result

    if backward == "joint":
        outputs = [forward(j) for j in range(width)]
        # One call for both endpoint graphs: under FSDP one all-gather per module per group.
        run_backward([outputs[0], outputs[-1]], [signal(0), signal(1)])
        result.backward_calls += 1
        return result
    for j in range(1, width - 1):
        forward(j)
    # Split needs no extra forward: the far endpoint's weight in each signal is exactly 0
    # (alpha_0 = 0, alpha_{W-1} = 1, and the ablation's weights), so s_base needs no
    # s_{W-1} and s_corr no s_0.
    for end, j in ((0, 0), (1, width - 1)):
        v = forward(j)
        run_backward([v], [signal(end)])
        result.backward_calls += 1
        del v
    return result
