"""The paper's and the authors' JAGG variants at the core: index weights, split vs joint
backward (gradient, calls, memory), the authors' schedule as an independent float64
reference, the window plan and selection, and bad configurations."""
import pytest
import torch

from authors_reference import authors_window_backward
from dancegrpo.utils.activation_meter import ActivationMeter
from dancegrpo.utils.metrics import PassCounter
from jagg_patch import (interpolation_weights, jagg_group_backward, make_policy_update, make_window_selection,
                        num_trained_windows, plan_windows)
from jagg_toy import M, NonlinearVelocity, Problem, cosine, exact_reference, flat_grad, jacobian, rel_err

T_PER_SAMPLE = torch.tensor([[0.90, 0.95, 0.80], [0.70, 0.85, 0.75], [0.55, 0.60, 0.40], [0.30, 0.20, 0.35]],
                            dtype=torch.float64)
T_SHARED = torch.tensor([0.9, 0.7, 0.55, 0.3], dtype=torch.float64)


def run(problem, **kw):
    problem.model.zero_grad(set_to_none=True)
    result = jagg_group_backward(problem.predict, problem.step_loss, problem.t, **kw)
    return flat_grad(problem.model), result


# ---------------------------------------------------------------- index weights

def test_index_weights_ignore_t():
    a = interpolation_weights([0.9, 0.1, 0.5, 0.2], rule="index")    # any t, even not monotone
    assert a.dtype == torch.float64
    assert torch.equal(a, torch.tensor([0.0, 1 / 3, 2 / 3, 1.0], dtype=torch.float64))
    per_sample = interpolation_weights(T_PER_SAMPLE[:3], rule="index")
    assert per_sample.shape == (3, M)
    assert torch.equal(per_sample, torch.tensor([[0.0] * M, [0.5] * M, [1.0] * M], dtype=torch.float64))
    # the timestep rule differs on unevenly spaced t, and agrees on evenly spaced t
    assert not torch.allclose(interpolation_weights(T_SHARED), interpolation_weights(T_SHARED, rule="index"))
    even = torch.tensor([0.9, 0.6, 0.3], dtype=torch.float64)
    assert torch.allclose(interpolation_weights(even), interpolation_weights(even, rule="index"), atol=1e-15)


def test_unknown_alpha_rule_is_rejected():
    with pytest.raises(ValueError, match="alpha rule"):
        interpolation_weights(T_SHARED, rule="linear")


# ---------------------------------------------------------------- split == joint

@pytest.mark.parametrize("mode", ["jagg", "endpoints"])
@pytest.mark.parametrize("alpha", ["timestep", "index"])
@pytest.mark.parametrize("t", [T_SHARED, T_PER_SAMPLE, T_PER_SAMPLE[[0, 3]]], ids=["shared", "per_sample", "w2"])
def test_split_backward_equals_joint(mode, alpha, t):
    problem = Problem(NonlinearVelocity(), t)
    joint, r_joint = run(problem, mode=mode, alpha=alpha, backward="joint")
    split, r_split = run(problem, mode=mode, alpha=alpha, backward="split")
    assert rel_err(split, joint) < 1e-12
    assert (r_joint.backward_calls, r_split.backward_calls) == (1, 2)
    width = problem.width
    for r in (r_joint, r_split):
        assert (r.forwards_grad, r.forwards_nograd) == (2, width - 2)
    assert r_split.loss == pytest.approx(r_joint.loss, rel=1e-12)


def test_split_order_and_counts():
    """Middles first without a graph, then each endpoint's forward and its own backward."""
    problem = Problem(NonlinearVelocity(), T_SHARED)
    counter = PassCounter(problem.model)
    events = []
    problem.model.register_forward_hook(lambda mod, inp, out: events.append("F" if out.requires_grad else "f"))
    original = torch.autograd.backward

    def counting(tensors, *a, **kw):
        events.append("B")
        return original(tensors, *a, **kw)

    torch.autograd.backward = counting
    try:
        run(problem, backward="split")
    finally:
        torch.autograd.backward = original
    assert events == ["f", "f", "F", "B", "F", "B"]
    assert counter.backwards == 2 * M and counter.forwards_grad == 2 * M


def test_index_alpha_split_equals_the_authors_schedule():
    """Float64, against tests/authors_reference.py (W no-grad forwards, then two separate endpoint
    passes), and against the Jacobian formula with index weights written out by hand."""
    for t in (T_SHARED, T_PER_SAMPLE):
        problem = Problem(NonlinearVelocity(), t)
        got, result = run(problem, alpha="index", backward="split")
        problem.model.zero_grad(set_to_none=True)
        loss = authors_window_backward(problem.predict, problem.step_loss, problem.width)
        assert rel_err(got, flat_grad(problem.model)) < 1e-12
        assert result.loss == pytest.approx(loss, rel=1e-12)
        w = problem.width
        j0, j1 = jacobian(problem, 0), jacobian(problem, w - 1)
        by_hand = 0
        for j in range(w):
            v = problem.predict(j).detach().requires_grad_(True)
            (s,) = torch.autograd.grad(problem.step_loss(j, v), v)
            a = j / (w - 1)
            by_hand = by_hand + torch.einsum("mop,mo->p", (1 - a) * j0 + a * j1, s.reshape(M, -1))
        assert rel_err(got, by_hand) < 1e-10
        assert cosine(got, exact_reference(problem)) < 1 - 1e-6   # an approximation, not the exact gradient


def test_split_holds_one_endpoint_graph_at_a_time():
    """Saved-for-backward peak: joint keeps both endpoint graphs (>= 2 G), split one (< 2 G),
    where G is what one forward with grad saves."""
    problem = Problem(NonlinearVelocity(hidden=64), T_SHARED)
    with ActivationMeter() as one:
        v = problem.predict(0)
    graph_bytes = one.peak_bytes
    del v
    assert graph_bytes > 0 and one.live_bytes == 0
    peaks = {}
    for backward in ("joint", "split"):
        problem.model.zero_grad(set_to_none=True)
        with ActivationMeter() as meter:
            jagg_group_backward(problem.predict, problem.step_loss, problem.t, backward=backward)
        assert meter.live_bytes == 0                       # every graph was freed
        peaks[backward] = meter.peak_bytes
    assert peaks["joint"] >= 2 * graph_bytes
    assert graph_bytes <= peaks["split"] < 1.5 * graph_bytes
    assert peaks["split"] < peaks["joint"]


# ---------------------------------------------------------------- window plan and selection

def kinds(groups):
    return [(g.members, g.jagg) for g in groups]


def test_window_plan_authors_geometry():
    # S 21 -> 20 transitions, W 5: 4 contiguous windows; tf 0.6 -> 2 trained per sample
    windows = plan_windows(20, 5, 1.0)
    assert kinds(windows) == [(tuple(range(5 * g, 5 * g + 5)), True) for g in range(4)]
    assert num_trained_windows(4, 0.6) == 2
    # jagg_frac 0.5: windows 0 and 1 JAGG (high noise), 2 and 3 exact
    assert [g.jagg for g in plan_windows(20, 5, 0.5)] == [True, True, False, False]
    # S 16, W 4: 15 transitions -> 4, 4, 4, 3
    assert [g.members for g in plan_windows(15, 4, 1.0)] == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11), (12, 13, 14)]
    # a window of one member is exact
    assert kinds(plan_windows(7, 3, 1.0))[-1] == ((6,), False)
    assert num_trained_windows(3, 0.2) == 1        # at least one window
    assert len(plan_windows(7, 7, 1.0)) == 1       # W = S-1: one window


def test_window_larger_than_trajectory_is_an_error():
    with pytest.raises(ValueError, match="--jagg_window"):
        plan_windows(7, 8, 1.0)
    with pytest.raises(ValueError, match="S-1"):
        make_window_selection(8)(4, 7, 0.6, torch.Generator().manual_seed(0))


def test_window_selection_draws_whole_contiguous_windows():
    select = make_window_selection(5)
    sel = select(200, 20, 0.6, torch.Generator().manual_seed(0))
    assert sel.steps.shape == (200, 10) and sel.num_train == 2 * 5
    drawn = []
    for row in sel.steps.tolist():
        starts = row[::5]
        assert all(s % 5 == 0 for s in starts) and starts == sorted(starts) and len(set(starts)) == 2
        assert row == [s + i for s in starts for i in range(5)]
        drawn.append(tuple(starts))
    assert len(set(drawn)) == 6                     # all C(4, 2) pairs occur
    counts = torch.bincount(torch.tensor([s // 5 for d in drawn for s in d]), minlength=4)
    assert counts.min() > 0.35 * 100                 # each window in about half of the samples
    again = select(200, 20, 0.6, torch.Generator().manual_seed(0))
    assert torch.equal(again.steps, sel.steps)


def test_window_selection_pads_the_short_last_window():
    sel = make_window_selection(4)(64, 15, 0.5, torch.Generator().manual_seed(1))   # 4 windows, 2 trained
    assert sel.num_train == 2 * 4 and sel.steps.shape[1] == 8
    lengths = (sel.steps >= 0).sum(dim=1)
    with_short = (sel.steps == 12).any(dim=1)
    assert torch.equal(lengths, torch.where(with_short, 7, 8))
    assert bool((sel.steps[with_short, -1] == -1).all())
    assert 0 < int(with_short.sum()) < 64


# ---------------------------------------------------------------- bad configurations

@pytest.mark.parametrize("kw, match", [
    (dict(grouping="windows"), "grouping"), (dict(alpha="linear"), "alpha rule"), (dict(backward="both"), "backward"),
    (dict(mode="fast"), "mode"), (dict(window=1), "window"),
])
def test_bad_config_is_rejected(kw, match):
    with pytest.raises(ValueError, match=match):
        make_policy_update(**kw)


@pytest.mark.parametrize("kw, match", [(dict(alpha="linear"), "alpha rule"), (dict(backward="both"), "backward")])
def test_group_backward_rejects_unknown_forms(kw, match):
    problem = Problem(NonlinearVelocity(), T_SHARED)
    with pytest.raises(ValueError, match=match):
        jagg_group_backward(problem.predict, problem.step_loss, problem.t, **kw)
