"""fastvideo/train_grpo_wan_2_1.py (text to video)."""
import torch

from .base import UpstreamFamily, is_fsdp, stacked


def integer_timesteps(timesteps):
    """The integers int(sigma * 1000) the video models get, in float64: alpha's ratios exact."""
    return timesteps.to(torch.float64)


INTEGER_ALPHA_NOTE = ("  timestep alpha: from the integers int(sigma * 1000) {model} model gets, in float64 (the "
                      "image trainers' int(sigma * 1000) / 1000 in float32 has the same ratios to float32 rounding)")


class WanUpstream(UpstreamFamily):
    """The prompt and the negative prompt are arguments; the step zeroes the gradients first and runs
    without --use_group too. With --cfg_infer > 1 one transformer call holds the n conditional rows,
    then the n unconditional ones. The clip is torch.nn.utils.clip_grad_norm_ over
    transformer.parameters(): under FSDP1 each rank clips by its own shard's norm (upstream's,
    reproduced)."""
    # Video latents: their frame count is not among the flags the adapter reads.
    output_bytes = staticmethod(lambda args: None)
    plan_note = INTEGER_ALPHA_NOTE.format(model="Wan's")
    alpha_timesteps = staticmethod(integer_timesteps)

    @staticmethod
    def prompts(named):
        return {"encoder_hidden_states": named["encoder_hidden_states"],
                "negative_prompt_embeds": named["negative_prompt_embeds"]}, named["caption"]

    @staticmethod
    def check(prompts):
        rows, num_samples = prompts["negative_prompt_embeds"].shape[0], prompts["encoder_hidden_states"].shape[0]
        if rows != num_samples:
            raise ValueError(f"upstream's Wan train_one_step got negative_prompt_embeds with {rows} rows for "
                             f"{num_samples} samples; jagg_patch.upstream gives each sample its own row (one per "
                             "prompt, repeated with it under --use_group), as the prompt's: pass one per prompt")

    @staticmethod
    def condition(traj, i, n):
        return {"encoder_hidden_states": stacked(traj.prompts["encoder_hidden_states"], i, n),
                "negative_prompt_embeds": stacked(traj.prompts["negative_prompt_embeds"], i, n)}

    @staticmethod
    def call_rows(args):
        cfg = getattr(args, "cfg_infer", None)
        if cfg is None:
            raise ValueError("upstream's Wan trainer reads --cfg_infer, which these arguments lack; "
                             "jagg_patch.upstream needs it to split a guided call into its samples")
        return 2 if cfg > 1 else 1

    @staticmethod
    def clip(transformer, max_grad_norm):
        return torch.nn.utils.clip_grad_norm_(transformer.parameters(), max_grad_norm)

    @staticmethod
    def clip_note(transformer):
        if not is_fsdp(transformer):
            return None
        return ("jagg_patch.upstream: upstream's Wan trainer clips with torch.nn.utils.clip_grad_norm_ on the "
                "FSDP transformer's parameters, so each rank clips by the norm of its own shard, not the full "
                "gradient's; reproduced as upstream does it (docs/upstream_differences.md)")
