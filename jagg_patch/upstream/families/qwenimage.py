"""fastvideo/train_grpo_qwenimage.py and train_grpo_qwenimage_edit.py."""
import torch

from .base import UpstreamFamily, stacked


class QwenImageUpstream(UpstreamFamily):
    """Prompts are arguments of train_one_step; the step does NOT zero the gradients first; without
    --use_group upstream's step fails (its embeddings are bound only under it); grpo_one_step gets the
    prompt cut to its original length and img_shapes."""
    zero_grad_first = False
    needs_group = True

    @staticmethod
    def prompts(named):
        return {"prompt_embeds": named["prompt_embeds"], "prompt_attention_masks": named["prompt_attention_masks"],
                "original_length": named["original_length"]}, named["caption"]

    @staticmethod
    def rollout_values(prompts, fixed):
        return {**prompts, "encoder_hidden_states": prompts["prompt_embeds"]}

    @staticmethod
    def condition(traj, i, n):
        prompts, args = traj.prompts, traj.args
        length = int(prompts["original_length"][i])
        lengths = traj.extra[0][i]   # all_txt_seq_lens: this sample's text lengths, as the rollout used them
        lengths = lengths.reshape(-1).tolist() if torch.is_tensor(lengths) else lengths
        lengths = list(lengths) if isinstance(lengths, (list, tuple)) else [int(lengths)]
        return {"encoder_hidden_states": stacked(prompts["prompt_embeds"][:, :length], i, n),
                "prompt_attention_masks": stacked(prompts["prompt_attention_masks"][:, :length], i, n),
                "txt_seq_lens": lengths * n, "img_shapes": [[(1, args.h // 16, args.w // 16)]] * n}


class QwenImageEditUpstream(QwenImageUpstream):
    """Qwen-Image's step plus a condition image. The model input is the latents followed by the
    condition's latents (all_image_latents, the rollout's 6th value) along the tokens, and the output
    holds both: grpo_one_step cuts it back, so the recorded output is the whole one. img_shapes pairs
    the target's size with the FIRST sample's condition size, for every sample, as upstream's step
    passes it."""
    # The condition image's tokens are in every output; their count is the data's, not the flags'.
    output_bytes = staticmethod(lambda args: None)

    @staticmethod
    def prompts(named):
        prompts, caption = QwenImageUpstream.prompts(named)
        return {**prompts, **{name: named[name] for name in ("calculated_height", "calculated_width",
                                                             "image_latents")}}, caption

    @staticmethod
    def condition(traj, i, n):
        values, prompts, args = QwenImageUpstream.condition(traj, i, n), traj.prompts, traj.args
        condition_size = (1, int(prompts["calculated_height"][0]) // 16, int(prompts["calculated_width"][0]) // 16)
        return {**values, "img_shapes": [[(1, args.h // 16, args.w // 16), condition_size]] * n,
                "image_latents": stacked(traj.extra[1], i, n)}
