"""The vanilla update loop's gradient against an independent float64 reference."""
import math

import pytest
import torch

from dancegrpo import trainer
from dancegrpo.algo.grpo import choose_train_steps, policy_update
from dancegrpo.algo import objective

from helpers import float64_setup, reference_loss


@pytest.mark.parametrize("update_batch_size", [1, 3])
def test_update_gradient_equals_float64_reference(make_args, update_batch_size):
    args, ctx, cond, rollout, adv = float64_setup(make_args, update_batch_size)
    n = adv.numel()
    steps = choose_train_steps(n, args.sampling_steps - 1, 4, torch.Generator().manual_seed(1))
    normaliser = args.gradient_accumulation_steps * 4
    params = [p for p in ctx.transformer.parameters() if p.requires_grad]

    ref = torch.autograd.grad(reference_loss(ctx.transformer, rollout, cond, adv, steps, ctx.sigmas, args,
                                             normaliser), params)
    for p in params:
        p.grad = None
    stats = trainer.accumulate_policy_gradient(ctx, rollout, cond, adv, torch.arange(n), steps, normaliser,
                                               policy_update)
    got = [p.grad for p in params]
    num = sum(((a - b) ** 2).sum() for a, b in zip(got, ref)).sqrt()
    den = sum((b ** 2).sum() for b in ref).sqrt()
    assert den > 0
    assert (num / den).item() < 1e-10
    assert stats.backward_calls == 4 * math.ceil(n / update_batch_size)


def test_grpo_one_step_is_the_loops_per_transition_log_prob(make_args, monkeypatch):
    """Upstream's name for one transition's new log-prob (forward with grad, then the SDE density)
    gives what the update loop computes for that transition."""
    args, ctx, cond, rollout, adv = float64_setup(make_args, 1)
    n = adv.numel()
    steps = choose_train_steps(n, args.sampling_steps - 1, 2, torch.Generator().manual_seed(3))
    seen, original = [], objective.transition_log_prob

    def recording(*a, **k):
        log_prob = original(*a, **k)
        seen.append(log_prob.detach().clone())
        return log_prob
    monkeypatch.setattr(objective, "transition_log_prob", recording)
    trainer.accumulate_policy_gradient(ctx, rollout, cond, adv, torch.arange(n), steps, 1, policy_update)
    monkeypatch.undo()
    assert len(seen) == 2 * n   # micro-batches of one sample, in order
    for b in range(n):
        for j, k in enumerate(steps[b].tolist()):
            got = trainer.grpo_one_step(ctx, rollout, {key: v[b:b + 1] for key, v in cond.items()},
                                        torch.tensor([b]), torch.tensor([k]))
            assert torch.equal(got.detach(), seen[2 * b + j]), (b, k)
