"""fastvideo/train_grpo_skyreels_i2v.py (image to video on fastvideo's HunyuanVideo model)."""
from .base import Rollout, stacked
from .hunyuan import FastvideoVideoUpstream, video_output_bytes


def _guided(args):
    cfg = getattr(args, "cfg_infer", None)
    if cfg is None:
        raise ValueError("upstream's SkyReels trainer reads --cfg_infer, which these arguments lack; "
                         "jagg_patch.upstream needs it to split a guided call into its samples")
    return cfg > 1


class SkyReelsI2VUpstream(FastvideoVideoUpstream):
    """One reward (./reward.txt) with advantages per group or, without --use_group, by every rank's
    rewards; the empty prompt (train_one_step's empty_cond_* arguments, one row) for the unguided half;
    one first frame (the rollout's 7th value) for every sample of the step, concatenated on the
    channels inside grpo_one_step. With --cfg_infer > 1 a call holds the n conditional rows, then the
    n unconditional ones, under a guidance tensor of fixed length 2: so a batched forward of several
    transitions through upstream's grpo_one_step runs only unguided."""
    read_flags = FastvideoVideoUpstream.read_flags + ("cfg_infer",)
    output_bytes = staticmethod(lambda args: video_output_bytes(args, 2 if _guided(args) else 1))

    @staticmethod
    def fixed_values(named):
        return {"empty_cond_hidden_states": named["empty_cond_hidden_states"].unsqueeze(0),
                "empty_cond_attention_mask": named["empty_cond_attention_mask"].unsqueeze(0)}

    @staticmethod
    def unpack(result):
        videos, z, rewards, all_latents, all_log_probs, sigma_schedule, first_frame_latents = result
        return Rollout({"reward": rewards}, all_latents, all_log_probs, sigma_schedule, (first_frame_latents,))

    @staticmethod
    def condition(traj, i, n):
        return {**FastvideoVideoUpstream.condition(traj, i, n),
                "empty_cond_hidden_states": stacked(traj.fixed["empty_cond_hidden_states"], 0, n),
                "empty_cond_attention_mask": stacked(traj.fixed["empty_cond_attention_mask"], 0, n),
                "first_frame_latents": stacked(traj.extra[0], 0, n)}

    @staticmethod
    def call_rows(args):
        return 2 if _guided(args) else 1

    @staticmethod
    def check_run(args, backward, rows=None):
        if backward == "batched" and _guided(args):
            raise ValueError(f"--jagg_backward batched with --cfg_infer {args.cfg_infer}: upstream's SkyReels "
                             "grpo_one_step passes a guidance of fixed length 2 to the doubled batch, which the "
                             "model cannot spread over several samples' rows; use --jagg_backward split or joint "
                             "(or --cfg_infer 1)")

    @staticmethod
    def print_sample(traj, i, last, reward_label):
        print("reward", traj.rewards["reward"][i].item(), flush=True)
        print("ratio", last.ratio, flush=True)
        print("advantage", traj.advantages["reward"][i].item(), flush=True)
        print("final loss", last.loss.item(), flush=True)
