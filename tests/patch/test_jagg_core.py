"""JAGG core: weights, the group backward in all modes against float64 references,
pass counting, and the group plan."""
import pytest
import torch

from dancegrpo.utils.metrics import PassCounter
from jagg_patch import interpolation_weights, jagg_group_backward, plan_groups
from jagg_toy import (M, AffineVelocity, NonlinearVelocity, Problem, affine_segment_states, cosine,
                      endpoints_reference, exact_reference, flat_grad, jagg_reference, rel_err)

# Decreasing model timesteps, different per sample (each sample trains its own transitions).
T_PER_SAMPLE = torch.tensor([[0.90, 0.95, 0.80], [0.70, 0.85, 0.75], [0.55, 0.60, 0.40], [0.30, 0.20, 0.35]],
                            dtype=torch.float64)
T_SHARED = torch.tensor([0.9, 0.7, 0.55, 0.3], dtype=torch.float64)


def run_group(problem, mode):
    problem.model.zero_grad(set_to_none=True)
    result = jagg_group_backward(problem.predict, problem.step_loss, problem.t, mode=mode)
    return flat_grad(problem.model), result


# ---------------------------------------------------------------- interpolation weights

def test_interpolation_weights_values_and_shapes():
    a = interpolation_weights([0.9, 0.7, 0.5, 0.1])
    assert a.dtype == torch.float64
    assert torch.allclose(a, torch.tensor([0.0, 0.25, 0.5, 1.0], dtype=torch.float64), atol=1e-15)
    per_sample = interpolation_weights(T_PER_SAMPLE)
    assert per_sample.shape == T_PER_SAMPLE.shape
    assert torch.equal(per_sample[0], torch.zeros(M, dtype=torch.float64))
    assert torch.equal(per_sample[-1], torch.ones(M, dtype=torch.float64))


@pytest.mark.parametrize("bad", [[0.5], [0.5, 0.5], [0.9, 0.4, 0.9], []])
def test_interpolation_weights_rejects_degenerate_groups(bad):
    with pytest.raises(ValueError):
        interpolation_weights(bad)


# ---------------------------------------------------------------- Theorem 1 and its non-vacuity

@pytest.mark.parametrize("t", [T_SHARED, T_PER_SAMPLE], ids=["shared_t", "per_sample_t"])
def test_theorem1_affine_model_on_segment_is_exact(t):
    problem = Problem(AffineVelocity(), t, z=affine_segment_states(t))
    exact = exact_reference(problem)
    g, _ = run_group(problem, "jagg")
    assert rel_err(g, exact) < 1e-10


def test_affine_model_off_segment_is_not_exact():
    """Theorem 1 needs the middle states on the segment; random middles break it."""
    problem = Problem(AffineVelocity(), T_SHARED)
    g, _ = run_group(problem, "jagg")
    assert rel_err(g, exact_reference(problem)) > 1e-3


@pytest.mark.parametrize("t", [T_SHARED, T_PER_SAMPLE], ids=["shared_t", "per_sample_t"])
def test_nonlinear_model_jagg_matches_its_formula_but_not_exact(t):
    problem = Problem(NonlinearVelocity(), t, z=affine_segment_states(t))
    g, _ = run_group(problem, "jagg")
    exact = exact_reference(problem)
    assert rel_err(g, jagg_reference(problem)) < 1e-10      # JAGG computes what the method says...
    assert cosine(g, exact) < 1 - 1e-6                         # ...which is not the exact gradient
    assert rel_err(g, exact) > 1e-4


# ---------------------------------------------------------------- the other modes and W = 2

@pytest.mark.parametrize("model_cls", [AffineVelocity, NonlinearVelocity])
def test_exact_mode_equals_float64_reference(model_cls):
    problem = Problem(model_cls(), T_PER_SAMPLE)
    g, _ = run_group(problem, "exact")
    assert rel_err(g, exact_reference(problem)) < 1e-12


@pytest.mark.parametrize("mode", ["jagg", "endpoints"])
def test_window_two_is_exact(mode):
    problem = Problem(NonlinearVelocity(), T_PER_SAMPLE[[0, 2]])
    g, result = run_group(problem, mode)
    assert rel_err(g, exact_reference(problem)) < 1e-12
    assert result.backward_calls == 1


@pytest.mark.parametrize("t", [T_SHARED, T_PER_SAMPLE], ids=["shared_t", "per_sample_t"])
def test_endpoints_ablation_matches_its_rule(t):
    problem = Problem(NonlinearVelocity(), t)
    g, _ = run_group(problem, "endpoints")
    assert rel_err(g, endpoints_reference(problem)) < 1e-12
    jagg, _ = run_group(problem, "jagg")
    assert rel_err(g, jagg) > 1e-3  # the ablation really drops the middles' signal


def test_group_loss_is_the_sum_of_member_losses():
    problem = Problem(NonlinearVelocity(), T_SHARED)
    with torch.no_grad():
        expected = sum(float(problem.step_loss(j, problem.predict(j))) for j in range(problem.width))
    for mode in ("jagg", "endpoints", "exact"):
        assert run_group(problem, mode)[1].loss == pytest.approx(expected, rel=1e-12)


def test_unknown_mode_is_rejected():
    problem = Problem(NonlinearVelocity(), T_SHARED)
    with pytest.raises(ValueError, match="mode"):
        jagg_group_backward(problem.predict, problem.step_loss, problem.t, mode="fast")


# ---------------------------------------------------------------- pass counting

@pytest.fixture
def count_backward_calls(monkeypatch):
    calls = []
    original = torch.autograd.backward

    def counting(tensors, *a, **kw):
        calls.append(len(tensors) if isinstance(tensors, (list, tuple)) else 1)
        return original(tensors, *a, **kw)

    monkeypatch.setattr(torch.autograd, "backward", counting)
    return calls


@pytest.mark.parametrize("width", [3, 4, 6])
def test_jagg_counts(width, count_backward_calls):
    t = torch.linspace(0.9, 0.2, width, dtype=torch.float64)
    problem = Problem(NonlinearVelocity(), t)
    counter = PassCounter(problem.model)
    outputs = []
    problem.model.register_forward_hook(lambda mod, inp, out: outputs.append(out.requires_grad))
    _, result = run_group(problem, "jagg")
    assert (result.forwards_grad, result.forwards_nograd, result.backward_calls) == (2, width - 2, 1)
    assert outputs == [True] + [False] * (width - 2) + [True]   # middles build no graph
    assert count_backward_calls == [2]                           # ONE call, on the two endpoint outputs
    assert counter.backwards == 2 * M                            # it reaches exactly the 2 endpoint graphs
    assert (counter.forwards_grad, counter.forwards_nograd) == (2 * M, (width - 2) * M)


def test_exact_counts(count_backward_calls):
    problem = Problem(NonlinearVelocity(), T_SHARED)
    counter = PassCounter(problem.model)
    _, result = run_group(problem, "exact")
    assert (result.forwards_grad, result.forwards_nograd, result.backward_calls) == (4, 0, 4)
    assert len(count_backward_calls) == 4 and counter.backwards == 4 * M


# ---------------------------------------------------------------- plan_groups

def kinds(groups):
    return [(g.members, g.jagg) for g in groups]


def test_plan_even_split_and_rounding():
    # 3 groups * 0.6 = 1.8 -> 2 JAGG groups (highest noise first)
    assert kinds(plan_groups(range(12), 4, 0.6)) == [((0, 1, 2, 3), True), ((4, 5, 6, 7), True),
                                                      ((8, 9, 10, 11), False)]


def test_plan_rounds_half_up():
    # 5 groups * 0.3 = 1.5 -> 2;  5 * 0.7 = 3.5 -> 4 (no float surprise);  4 * 0.125 = 0.5 -> 1
    assert sum(g.jagg for g in plan_groups(range(10), 2, 0.3)) == 2
    assert sum(g.jagg for g in plan_groups(range(10), 2, 0.7)) == 4
    assert sum(g.jagg for g in plan_groups(range(8), 2, 0.125)) == 1


def test_plan_remainder_group_and_members_kept():
    groups = plan_groups([1, 3, 4, 6, 7], 2, 1.0)
    assert kinds(groups) == [((1, 3), True), ((4, 6), True), ((7,), False)]  # a group of 1 is exact
    assert [g.index for g in groups] == [0, 1, 2]


def test_plan_window_larger_than_n():
    assert kinds(plan_groups([2, 5, 6], 8, 0.6)) == [((2, 5, 6), True)]
    assert kinds(plan_groups([4], 4, 1.0)) == [((4,), False)]


@pytest.mark.parametrize("frac, expected", [(0, [False, False]), (0.0, [False, False]), (1, [True, True])])
def test_plan_fraction_limits(frac, expected):
    assert [g.jagg for g in plan_groups(range(6), 3, frac)] == expected


@pytest.mark.parametrize("steps, window, frac, match", [
    (range(4), 1, 0.5, "window"), (range(4), 0, 0.5, "window"), (range(4), 2.0, 0.5, "window"),
    (range(4), 2, -0.1, "jagg_frac"), (range(4), 2, 1.5, "jagg_frac"), (range(4), 2, float("nan"), "jagg_frac"),
    ([], 2, 0.5, "no trained"), ([3, 1, 2], 2, 0.5, "increasing"), ([1, 1, 2], 2, 0.5, "increasing"),
])
def test_plan_invalid_values(steps, window, frac, match):
    with pytest.raises(ValueError, match=match):
        plan_groups(steps, window, frac)
