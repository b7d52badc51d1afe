"""fastvideo/train_grpo_flux.py and train_grpo_flux_lora.py."""
from .base import UpstreamFamily, stacked


class FluxUpstream(UpstreamFamily):
    """Prompts from next(loader); the step zeroes the gradients first; the clip is FSDP's
    transformer.clip_grad_norm_."""

    @staticmethod
    def prompts(named):
        encoder_hidden_states, pooled_prompt_embeds, text_ids, caption = next(named["loader"])
        return {"encoder_hidden_states": encoder_hidden_states, "pooled_prompt_embeds": pooled_prompt_embeds,
                "text_ids": text_ids}, caption

    @staticmethod
    def condition(traj, i, n):
        # text_ids and image_ids stay one row: grpo_one_step repeats text_ids over the tokens and
        # squeezes image_ids, which are the same for every sample (all_image_ids, extra[0]).
        prompts = traj.prompts
        return {"encoder_hidden_states": stacked(prompts["encoder_hidden_states"], i, n),
                "pooled_prompt_embeds": stacked(prompts["pooled_prompt_embeds"], i, n),
                "text_ids": prompts["text_ids"][i:i + 1], "image_ids": traj.extra[0][i:i + 1]}
