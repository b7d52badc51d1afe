"""fastvideo/train_grpo_hunyuan.py (text to video on fastvideo's HunyuanVideo model), and the rules
it shares with the SkyReels image-to-video trainer (FastvideoVideoUpstream)."""
import torch

from dancegrpo.algo.grpo import ppo_clip_loss
from dancegrpo.utils.metrics import reward_summary

from ...seams import UPSTREAM_REWARD_NAMES

from .base import Rollout, UpstreamFamily, group_advantages, stacked
from .wan import INTEGER_ALPHA_NOTE, integer_timesteps

# Written in these trainers' loops, not read from flags.
PPO_CLIP_RANGE, ADV_CLIP_MAX = 1e-4, 5.0
LATENT_CHANNELS = 16


def video_output_bytes(args, rows=1):
    """Bytes per sample of the kept rollout outputs: S outputs of `rows` x 16 channels x latent_t x
    (h/8) x (w/8), latent_t = (t - 1) // 4 + 1, as the model computes them (bf16 under CUDA autocast,
    float32 on a CPU-only machine)."""
    from dancegrpo.utils.precision import bytes_per_output
    latent_t = (args.t - 1) // 4 + 1
    return (args.sampling_steps * rows * LATENT_CHANNELS * latent_t * (args.h // 8) * (args.w // 8)
            * bytes_per_output(torch.cuda.is_available()))


class FastvideoVideoUpstream(UpstreamFamily):
    """What the HunyuanVideo and SkyReels trainers share: prompts and their attention mask from
    next(loader), the gradients zeroed first, the integer timesteps int(sigma * 1000) to the model
    (alpha from them in float64), the PPO clip 1e-4 and the advantage clamp 5.0 written in the loop,
    FSDP's transformer.clip_grad_norm_."""
    alpha_timesteps = staticmethod(integer_timesteps)
    plan_note = INTEGER_ALPHA_NOTE.format(model="the HunyuanVideo")
    output_bytes = staticmethod(video_output_bytes)
    read_flags = ("use_group", "num_generations", "train_batch_size", "gradient_accumulation_steps",
                  "sampling_steps", "timestep_fraction", "h", "w", "t", "use_videoalign")

    @staticmethod
    def check_flags(args):
        if not args.use_videoalign:
            raise ValueError("upstream's video trainers score a sample only with --use_videoalign (VideoAlign): "
                             "without it the rollout collects no reward and ends in torch.cat of an empty list; add "
                             "--use_videoalign")

    @staticmethod
    def prompts(named):
        encoder_hidden_states, encoder_attention_mask, caption = next(named["loader"])
        return {"encoder_hidden_states": encoder_hidden_states, "encoder_attention_mask": encoder_attention_mask}, caption

    @staticmethod
    def condition(traj, i, n):
        return {"encoder_hidden_states": stacked(traj.prompts["encoder_hidden_states"], i, n),
                "encoder_attention_mask": stacked(traj.prompts["encoder_attention_mask"], i, n)}

    @staticmethod
    def clip_range(args):
        return PPO_CLIP_RANGE

    @staticmethod
    def adv_clip_max(args):
        return ADV_CLIP_MAX


class HunyuanVideoUpstream(FastvideoVideoUpstream):
    """Two VideoAlign rewards (VQ, MQ), each with its own advantages per block of num_generations on
    the rank's rewards (no branch without --use_group), one loss vq_coef * L_vq + mq_coef * L_mq over
    one ratio, best-of-n over the rank's whole batch, the reward files ./vq_reward.txt and
    ./mq_reward.txt."""
    read_flags = FastvideoVideoUpstream.read_flags + ("bestofn", "vq_coef", "mq_coef")
    reward_names = UPSTREAM_REWARD_NAMES["hunyuan"]

    @staticmethod
    def unpack(result):
        videos, z, vq_rewards, mq_rewards, all_latents, all_log_probs, sigma_schedule = result
        return Rollout({"vq": vq_rewards, "mq": mq_rewards}, all_latents, all_log_probs, sigma_schedule, ())

    @classmethod
    def advantages(cls, rewards, gathered, args):
        return {name: group_advantages(rewards[name], args.num_generations) for name in cls.reward_names}

    @staticmethod
    def best_of_n(advantages, args):
        """Upstream's selection: by vq_coef * A_vq + mq_coef * A_mq over the rank's batch, the top
        ceil(bestofn / 2) then the bottom floor(bestofn / 2), shuffled by a permutation drawn from the
        global generator (drawn whether or not the selection is applied)."""
        order = torch.argsort(args.vq_coef * advantages["vq"] + args.mq_coef * advantages["mq"])
        selected = torch.cat([order[-args.bestofn // 2:], order[:args.bestofn // 2]])
        return selected[torch.randperm(len(selected))]

    @classmethod
    def select(cls, traj, args):
        selected = cls.best_of_n(traj.advantages, args)
        # Upstream compares with num_generations, not with the batch: bestofn == G trains all P * G samples.
        return traj if args.num_generations == args.bestofn else traj.take(selected.to(traj.latents.device))

    @staticmethod
    def trained_samples(args, rows):
        return rows if args.num_generations == args.bestofn else args.bestofn

    @staticmethod
    def check_flags(args):
        FastvideoVideoUpstream.check_flags(args)
        if args.bestofn < 1:
            raise ValueError(f"--bestofn must be at least 1, got {args.bestofn}")

    @staticmethod
    def notice(args, rows):
        """Without --use_group the advantages are still taken per block of num_generations rows of the
        rank's batch (upstream's): rows after the last whole block get 0 and train nothing."""
        g = args.num_generations
        idle = rows % g if g > 0 else rows
        if args.use_group or idle == 0:
            return None
        what = "every sample gets" if idle == rows else f"{idle} of the {rows} samples get"
        return (f"notice: without --use_group HunyuanVideo's advantages are taken per block of --num_generations "
                f"{g} rows of the rank's {rows}: {what} advantage 0 and train nothing (as upstream); add "
                "--use_group, or make the rank's batch a multiple of --num_generations")

    @classmethod
    def check_run(cls, args, backward, rows=None):
        cls.check_flags(args)
        # Up to 2 * rows the top and the bottom overlap and upstream trains those samples twice (reproduced);
        # beyond, its selection holds fewer than bestofn rows and its per-sample draw fails indexing them.
        if rows is not None and args.num_generations != args.bestofn and (args.bestofn + 1) // 2 > rows:
            raise ValueError(f"--bestofn {args.bestofn} needs at least {(args.bestofn + 1) // 2} samples per rank, "
                             f"the rank draws {rows}: upstream's best-of-n would select fewer than --bestofn samples "
                             "and fail indexing them; lower --bestofn")

    @classmethod
    def sample_loss(cls, log_prob, old, advantages, normaliser, args):
        """vq_coef * L_vq + mq_coef * L_mq over one ratio, and (L_vq, L_mq) for the print."""
        losses = {name: torch.mean(ppo_clip_loss(log_prob, old, advantages[name], PPO_CLIP_RANGE, ADV_CLIP_MAX))
                  / normaliser for name in ("vq", "mq")}
        final = args.vq_coef * losses["vq"] + args.mq_coef * losses["mq"]
        return final, (losses["vq"].detach(), losses["mq"].detach())

    @staticmethod
    def print_sample(traj, i, last, reward_label):
        clamped = [traj.advantages[name][i].clamp(-ADV_CLIP_MAX, ADV_CLIP_MAX).item() for name in ("vq", "mq")]
        print("vq loss/mq loss", *(term.item() for term in last.terms), flush=True)
        print("vq/mq reward", traj.rewards["vq"][i].item(), traj.rewards["mq"][i].item(), flush=True)
        print(" ratio", last.ratio, flush=True)
        print("vq advantage/mq advantage", *clamped, flush=True)
        print("final loss", last.loss.item(), flush=True)

    @staticmethod
    def reward_record(gathered, args):
        """Both rewards' mean / std over every rank, and as reward_mean / reward_std the reward the loss
        weighs, vq_coef * VQ + mq_coef * MQ per sample."""
        record = {f"{name}_{key}": value for name in ("vq", "mq")
                  for key, value in reward_summary(gathered[name]).items()}
        return {**record, **reward_summary(args.vq_coef * gathered["vq"] + args.mq_coef * gathered["mq"])}
