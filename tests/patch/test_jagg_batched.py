"""--jagg_backward batched: both endpoints of a JAGG group in ONE forward (the samples stacked
twice) and one backward of that single graph; and `auto`, which picks it on several ranks."""
import pytest
import torch

from dancegrpo.algo import grpo
from dancegrpo import trainer
from jagg_patch import jagg_group_backward, make_policy_update
from jagg_patch.core import resolve_backward
from jagg_toy import NonlinearVelocity, Problem, endpoints_reference, flat_grad, jagg_reference, rel_err

from helpers import float64_setup, keep_rollout_outputs

T_PER_SAMPLE = [[0.95, 0.9, 0.97], [0.9, 0.8, 0.93], [0.8, 0.75, 0.85], [0.7, 0.6, 0.72]]


def predict_pair(problem, calls):
    """Members i and j of every sample from one model call on the stacked states."""
    def pair(i, j):
        calls.append((i, j))
        m = problem.z.shape[1]
        out = problem.model(torch.cat([problem.z[i], problem.z[j]]), torch.cat([problem.t_of(i), problem.t_of(j)]))
        return out[:m], out[m:]
    return pair


@pytest.mark.parametrize("mode, reference", [("jagg", jagg_reference), ("endpoints", endpoints_reference)])
def test_batched_backward_float64(mode, reference):
    problem = Problem(NonlinearVelocity(), T_PER_SAMPLE)
    calls = []
    result = jagg_group_backward(problem.predict, problem.step_loss, problem.t, mode, "timestep", "batched",
                                 predict_pair=predict_pair(problem, calls))
    assert rel_err(flat_grad(problem.model), reference(problem)) < 1e-12
    assert calls == [(0, 3)]
    assert (result.forwards_grad, result.forwards_nograd, result.backward_calls) == (2, 2, 1)


def test_batched_without_pair_is_refused():
    problem = Problem(NonlinearVelocity(), T_PER_SAMPLE)
    with pytest.raises(ValueError, match="needs predict_pair"):
        jagg_group_backward(problem.predict, problem.step_loss, problem.t, "jagg", "timestep", "batched")


def test_auto_is_batched_on_several_ranks_and_split_on_one(monkeypatch):
    assert resolve_backward("auto", 1) == "split" and resolve_backward("auto", 8) == "batched"
    assert resolve_backward("joint", 8) == "joint"
    monkeypatch.setenv("WORLD_SIZE", "4")   # torchrun's, before the process group exists
    assert resolve_backward("auto") == "batched"


@pytest.mark.parametrize("reuse", ["off", "on_policy"])
def test_trainer_batched_equals_joint_float64(make_args, reuse):
    """Micro-batches of 3 with per-sample transitions: the stacked forward of the trainer's
    predict_batched gives the joint backward's gradient."""
    args, ctx, cond, rollout, adv = float64_setup(make_args, 3)
    n, S = adv.numel(), args.sampling_steps
    keep_rollout_outputs(ctx, rollout, cond)
    steps = grpo.choose_train_steps(n, S - 1, 4, torch.Generator().manual_seed(1))

    def update(backward):
        ctx.transformer.zero_grad(set_to_none=True)
        ctx.counter.reset()
        stats = trainer.accumulate_policy_gradient(ctx, rollout, cond, adv, torch.arange(n), steps, 32,
                                                   make_policy_update(window=4, jagg_frac=1.0, backward=backward, reuse=reuse),
                                                   on_policy=True)
        grads = torch.cat([p.grad.reshape(-1) for p in ctx.transformer.parameters()])
        return grads, stats, ctx.counter.as_dict()

    joint, joint_stats, joint_counts = update("joint")
    batched, stats, counts = update("batched")
    assert rel_err(batched, joint) < 1e-12
    assert stats.backward_calls == joint_stats.backward_calls == -(-n // 3)
    assert counts == joint_counts     # per sample: 2 forwards with grad, 2 backwards, the same middles
    assert counts["transformer_backwards"] == 2 * n
