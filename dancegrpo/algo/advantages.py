"""Advantages from rewards: a registry of rules (--advantage NAME), one entry per rule."""
import torch

from ..errors import ConfigError


def group_advantages(rewards, num_generations, eps=1e-8):
    """(r - mean) / (std + eps) inside each contiguous block of `num_generations`.

    std is the unbiased one, as upstream (torch.std default).
    """
    if rewards.numel() % num_generations:
        raise ConfigError(f"{rewards.numel()} rewards do not split into groups of {num_generations}")
    groups = rewards.reshape(-1, num_generations)
    if num_generations < 2:
        raise ConfigError("--use_group needs --num_generations >= 2 (a group of 1 has no spread)")
    adv = (groups - groups.mean(dim=1, keepdim=True)) / (groups.std(dim=1, keepdim=True) + eps)
    return adv.reshape(-1)


def flow_grpo_advantages(rewards, num_generations, all_rewards=None, eps=1e-4):
    """Flow-GRPO's advantage: (r - prompt mean) / (std + 1e-4), std the population std of the
    prompt's rewards, or of `all_rewards` (every rank's) with --global_std. A prompt's
    generations are a contiguous block of `num_generations`."""
    if rewards.numel() % num_generations:
        raise ConfigError(f"{rewards.numel()} rewards do not split into groups of {num_generations}")
    groups = rewards.reshape(-1, num_generations)
    std = groups.std(dim=1, unbiased=False, keepdim=True) if all_rewards is None else all_rewards.std(unbiased=False)
    return ((groups - groups.mean(dim=1, keepdim=True)) / (std + eps)).reshape(-1)


def global_advantages(rewards, all_rewards, eps=1e-8):
    """Normalise this rank's rewards by the statistics of every rank's rewards."""
    return (rewards - all_rewards.mean()) / (all_rewards.std() + eps)


def dance_advantages(rewards, all_rewards, args):
    """DanceGRPO's rule: per group of --num_generations with --use_group, else over every rank's rewards."""
    if args.use_group:
        return group_advantages(rewards, args.num_generations)
    return global_advantages(rewards, all_rewards)


def flow_grpo_rule(rewards, all_rewards, args):
    """Flow-GRPO's rule: per prompt, with one std over every rank's rewards under --global_std."""
    return flow_grpo_advantages(rewards, args.num_generations, all_rewards if args.global_std else None)


# --advantage NAME -> fn(this rank's rewards, every rank's rewards, args): a new rule is one entry.
ADVANTAGES = {"dance": dance_advantages, "flow_grpo": flow_grpo_rule}


def compute_advantages(ctx, rewards, all_rewards, host_gen):
    """The --advantage rule (ADVANTAGES); with --shuffle_advantages randomly permuted."""
    args = ctx.args
    adv = ADVANTAGES[args.advantage](rewards, all_rewards, args)
    if args.shuffle_advantages:  # control: same magnitudes, no relation to the samples
        adv = adv[torch.randperm(adv.numel(), generator=host_gen).to(adv.device)]
    return adv
