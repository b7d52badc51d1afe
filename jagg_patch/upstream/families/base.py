"""The parts every upstream trainer family has, with the image trainers' rules as the defaults
(Flux's, which the other families change where their train_one_step differs): the restated step
(jagg_patch.upstream.step) calls these and nothing family-specific of its own.
"""
from collections import namedtuple

import torch

from dancegrpo.algo.grpo import ppo_clip_loss
from dancegrpo.utils.metrics import reward_summary

from ...cli import upstream_output_bytes

# sample_reference_model's values as the step reads them: rewards by name ({"reward": [B]}; HunyuanVideo
# {"vq": [B], "mq": [B]}), all_latents [B, S+1, ...], all_log_probs [B, S], sigma_schedule [S+1], and the
# values the family's grpo_one_step needs besides (a tuple).
Rollout = namedtuple("Rollout", "rewards latents log_probs sigma_schedule extra")


def repeat_rows(value, n):
    """Each row n times in contiguous blocks: torch.repeat_interleave on dim 0, or per list item."""
    if torch.is_tensor(value):
        return torch.repeat_interleave(value, n, dim=0)
    return [item for item in value for _ in range(n)]


def repeat_captions(caption, n):
    """Upstream's rule: a str becomes n copies, a list repeats each item n times, anything else fails."""
    if isinstance(caption, str):
        return [caption] * n
    if isinstance(caption, list):
        return [item for item in caption for _ in range(n)]
    raise ValueError(f"Unsupported caption type: {type(caption)}")


def stacked(tensor, i, n):
    """Row i of `tensor` as a batch of n identical rows."""
    row = tensor[i:i + 1]
    return row if n == 1 else row.expand(n, *row.shape[1:]).contiguous()


def group_advantages(rewards, g):
    """Per consecutive block of g rows: (r - mean) / (unbiased std + 1e-8); rows after the last full
    block keep 0."""
    advantages = torch.zeros_like(rewards)
    for start in range(0, len(rewards) // g * g, g):
        group = rewards[start:start + g]
        advantages[start:start + g] = (group - group.mean()) / (group.std() + 1e-8)
    return advantages


def group_or_global_advantages(rewards, gathered, args):
    """Per group of num_generations under --use_group; without groups, by the statistics of every
    rank's rewards (`gathered`)."""
    if not args.use_group:
        return (rewards - gathered.mean()) / (gathered.std() + 1e-8)
    return group_advantages(rewards, args.num_generations)


def is_fsdp(module):
    from torch.distributed.fsdp import FullyShardedDataParallel
    return isinstance(module, FullyShardedDataParallel)


class UpstreamFamily:
    """One upstream trainer's rules. The defaults are the image trainers': prompts from the
    arguments the family names, the gradients zeroed first, one reward with advantages per group (or
    by every rank's rewards), the PPO clip and advantage clamp from --clip_range / --adv_clip_max,
    every sample trained, FSDP's transformer.clip_grad_norm_."""
    zero_grad_first = True
    needs_group = False
    reward_names = ("reward",)   # the rollout's rewards, in the order train_one_step reports them (seams)
    plan_note = None   # a line the start-up plan adds for this family
    # What the plan says the kept rollout outputs cost per sample (None: not sized by the flags alone).
    output_bytes = staticmethod(upstream_output_bytes)
    # The flags of upstream's parser that the restated step and the plan read.
    read_flags = ("use_group", "num_generations", "train_batch_size", "gradient_accumulation_steps",
                  "sampling_steps", "timestep_fraction", "clip_range", "adv_clip_max")

    @staticmethod
    def alpha_timesteps(timesteps):
        """The timesteps JAGG's alpha is taken from, as the model gets them: int(sigma * 1000) / 1000
        (`timesteps`: the long integers), the image trainers' float32 values."""
        return timesteps / 1000

    @staticmethod
    def prompts(named):
        """(the per-sample prompt tensors by upstream's names, caption) from train_one_step's arguments."""
        raise NotImplementedError

    @staticmethod
    def fixed_values(named):
        """Values every sample of the step shares (not group-repeated), by upstream's names."""
        return {}

    @staticmethod
    def check(prompts):
        """Refuse, before the rollout, prompt tensors the restated step would pass on wrongly."""

    @staticmethod
    def check_flags(args):
        """Refuse, at the launcher's preflight (before anything loads), flag values of this trainer's
        own that no step can run with."""

    @staticmethod
    def notice(args, rows):
        """A line the preflight says about flags this trainer runs with as upstream does but which
        train less than a user would expect (None: nothing to say); `rows`: the samples per rank."""
        return None

    @staticmethod
    def check_run(args, backward, rows=None):
        """Refuse, before the rollout, flags this trainer's step cannot run with (`backward`: the
        resolved backward form; `rows`: the samples the rollout draws, None where not yet known)."""

    @staticmethod
    def rollout_values(prompts, fixed):
        """sample_reference_model's prompt arguments by name."""
        return {**prompts, **fixed}

    @staticmethod
    def unpack(result):
        rewards, all_latents, all_log_probs, sigma_schedule, *extra = result
        return Rollout({"reward": rewards}, all_latents, all_log_probs, sigma_schedule, tuple(extra))

    @staticmethod
    def condition(traj, i, n):
        """grpo_one_step's conditioning arguments for sample i, stacked n times (a batched forward)."""
        raise NotImplementedError

    @staticmethod
    def call_rows(args):
        """Rows one transformer call holds per sample (2 for a classifier-free-guided call)."""
        return 1

    @staticmethod
    def clip_range(args):
        return args.clip_range

    @staticmethod
    def adv_clip_max(args):
        return args.adv_clip_max

    @staticmethod
    def advantages(rewards, gathered, args):
        """{reward name: [B] advantages} from the local and the gathered rewards."""
        return {"reward": group_or_global_advantages(rewards["reward"], gathered["reward"], args)}

    @staticmethod
    def select(traj, args):
        """The trajectories the step trains, in order (all of them, unless the family selects)."""
        return traj

    @staticmethod
    def trained_samples(args, rows):
        """How many samples a step trains when the rollout has `rows`."""
        return rows

    @classmethod
    def sample_loss(cls, log_prob, old, advantages, normaliser, args):
        """One transition's loss, mean PPO-clip over the sample / (GA * train_timesteps), and the terms
        the sample's print shows besides it (none). `advantages`: this sample's, by reward name."""
        per_sample = ppo_clip_loss(log_prob, old, advantages["reward"], cls.clip_range(args), cls.adv_clip_max(args))
        return torch.mean(per_sample) / normaliser, ()

    @staticmethod
    def print_sample(traj, i, last, reward_label):
        """Upstream's per-sample print (ranks whose rank % 8 == 0); `last`: the step's LastTransition;
        `reward_label`: the release's ("hps reward" before bbf5278)."""
        print(reward_label, traj.rewards["reward"][i].item(), "ratio", last.ratio, "advantage",
              traj.advantages["reward"][i].item(), "final loss", last.loss.item(), flush=True)

    @staticmethod
    def reward_record(gathered, args):
        """The metrics line's rewards: reward_mean / reward_std of every rank's rewards."""
        return reward_summary(gathered["reward"])

    @staticmethod
    def clip(transformer, max_grad_norm):
        clip = getattr(transformer, "clip_grad_norm_", None)
        if clip is not None:
            return clip(max_grad_norm)
        return torch.nn.utils.clip_grad_norm_([p for p in transformer.parameters() if p.requires_grad],
                                              max_grad_norm)

    @staticmethod
    def clip_note(transformer):
        """A line to print once per run about upstream's clip on this transformer, or None."""
        return None
