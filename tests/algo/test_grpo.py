import pytest
import torch

from dancegrpo.errors import ConfigError
from dancegrpo.algo.advantages import global_advantages, group_advantages
from dancegrpo.algo.grpo import choose_train_steps, num_train_timesteps, ppo_clip_loss


def test_group_advantages_hand_computed():
    r = torch.tensor([1.0, 2.0, 3.0, 4.0, 10.0, 10.0, 10.0, 13.0])
    adv = group_advantages(r, 4)
    std1 = (sum((x - 2.5) ** 2 for x in [1, 2, 3, 4]) / 3) ** 0.5  # unbiased, as upstream
    std2 = ((3 * 0.75 ** 2 + 2.25 ** 2) / 3) ** 0.5
    expected = [(x - 2.5) / (std1 + 1e-8) for x in [1, 2, 3, 4]] + [(x - 10.75) / (std2 + 1e-8) for x in [10, 10, 10, 13]]
    assert torch.allclose(adv, torch.tensor(expected), atol=1e-6)


def test_group_advantages_bad_group_size():
    with pytest.raises(ConfigError):
        group_advantages(torch.ones(6), 4)


def test_global_advantages_use_all_ranks_statistics():
    local, everything = torch.tensor([1.0, 3.0]), torch.tensor([1.0, 3.0, 5.0, 7.0])
    std = everything.std().item()
    assert torch.allclose(global_advantages(local, everything), torch.tensor([(1 - 4) / std, (3 - 4) / std]), atol=1e-6)


@pytest.mark.parametrize("adv,ratio,eps,expected", [
    (1.0, 1.5, 0.2, -1.2),     # positive advantage, ratio above 1+eps: clipped term wins
    (1.0, 0.5, 0.2, -0.5),     # positive advantage, ratio below: unclipped term wins
    (-1.0, 0.5, 0.2, 0.8),     # negative advantage, ratio below 1-eps: clipped wins
    (-1.0, 1.5, 0.2, 1.5),     # negative advantage, ratio above: unclipped wins
    (10.0, 1.0, 0.2, -5.0),    # advantage clamped to adv_clip_max = 5
    (-10.0, 1.0, 0.2, 5.0),
])
def test_ppo_clip_loss_hand_computed(adv, ratio, eps, expected):
    loss = ppo_clip_loss(torch.log(torch.tensor([ratio], dtype=torch.float64)), torch.zeros(1, dtype=torch.float64),
                         torch.tensor([adv], dtype=torch.float64), eps, 5.0)
    assert loss.item() == pytest.approx(expected, abs=1e-12)


def test_ppo_clip_gradient_is_zero_when_clipped():
    logp = torch.tensor([0.5], requires_grad=True)
    ppo_clip_loss(logp, torch.zeros(1), torch.ones(1), 0.2, 5.0).sum().backward()
    assert logp.grad.item() == 0.0


def test_num_train_timesteps():
    assert num_train_timesteps(15, 0.6) == 9   # upstream Flux: S=16, fraction 0.6
    assert num_train_timesteps(19, 0.6) == 11  # upstream Qwen-Image: S=20
    assert num_train_timesteps(7, 1.0) == 7
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ConfigError):
            num_train_timesteps(15, bad)
    with pytest.raises(ConfigError):
        num_train_timesteps(3, 0.2)


def test_choose_train_steps_is_a_per_sample_subset():
    steps = choose_train_steps(64, 15, 9, torch.Generator().manual_seed(0))
    assert steps.shape == (64, 9)
    assert all(len(set(row.tolist())) == 9 for row in steps)
    assert steps.min() >= 0 and steps.max() <= 14
    assert len({tuple(r.tolist()) for r in steps}) > 1  # each sample draws its own subset
    again = choose_train_steps(64, 15, 9, torch.Generator().manual_seed(0))
    assert torch.equal(steps, again)


def test_advantage_rules_are_a_registry_the_flag_and_the_trainer_read():
    import types

    from dancegrpo import trainer
    from dancegrpo.args import build_parser
    from dancegrpo.algo.advantages import ADVANTAGES
    (action,) = [a for a in build_parser("flux", "")._actions if "--advantage" in a.option_strings]
    assert tuple(action.choices) == tuple(ADVANTAGES) == ("dance", "flow_grpo")
    rewards = torch.tensor([1.0, 2.0, 4.0, 0.0, 3.0, 3.5])
    args = types.SimpleNamespace(num_generations=3, use_group=True, global_std=False, shuffle_advantages=False)
    by_hand = {"dance": group_advantages(rewards, 3),
               "flow_grpo": (rewards.reshape(2, 3) - rewards.reshape(2, 3).mean(1, keepdim=True)).reshape(-1)
               / (rewards.reshape(2, 3).std(1, unbiased=False, keepdim=True).repeat_interleave(3).reshape(-1) + 1e-4)}
    for name, expected in by_hand.items():
        args.advantage = name
        got = trainer.compute_advantages(types.SimpleNamespace(args=args), rewards, rewards, None)
        assert torch.allclose(got, expected), name
