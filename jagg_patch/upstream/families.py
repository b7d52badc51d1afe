"""What differs between upstream's trainers, as the restated train_one_step needs it: where a
step's prompts come from, whether the step zeroes the gradients first, and the conditioning
arguments of grpo_one_step for one sample (stacked n times for a batched forward).

A registry: the family name (jagg_patch.upstream.fingerprint.family_of) -> its rules.
"""
import torch


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


def _stacked(tensor, i, n):
    """Row i of `tensor` as a batch of n identical rows."""
    row = tensor[i:i + 1]
    return row if n == 1 else row.expand(n, *row.shape[1:]).contiguous()


class FluxUpstream:
    """fastvideo/train_grpo_flux.py: prompts from next(loader); the step zeroes the gradients first."""
    zero_grad_first = True
    needs_group = False

    @staticmethod
    def prompts(named):
        encoder_hidden_states, pooled_prompt_embeds, text_ids, caption = next(named["loader"])
        return {"encoder_hidden_states": encoder_hidden_states, "pooled_prompt_embeds": pooled_prompt_embeds,
                "text_ids": text_ids}, caption

    @staticmethod
    def rollout_values(prompts):
        return prompts

    @staticmethod
    def condition(prompts, rollout_extra, i, n, args):
        # text_ids and image_ids stay one row: grpo_one_step repeats text_ids over the tokens and
        # squeezes image_ids, which are the same for every sample (all_image_ids is the 5th rollout value).
        return {"encoder_hidden_states": _stacked(prompts["encoder_hidden_states"], i, n),
                "pooled_prompt_embeds": _stacked(prompts["pooled_prompt_embeds"], i, n),
                "text_ids": prompts["text_ids"][i:i + 1], "image_ids": rollout_extra[i:i + 1]}


class QwenImageUpstream:
    """fastvideo/train_grpo_qwenimage.py: prompts are arguments of train_one_step; the step does NOT
    zero the gradients first; without --use_group upstream's step fails (its embeddings are bound only
    under it); grpo_one_step gets the prompt cut to its original length and img_shapes."""
    zero_grad_first = False
    needs_group = True

    @staticmethod
    def prompts(named):
        return {"prompt_embeds": named["prompt_embeds"], "prompt_attention_masks": named["prompt_attention_masks"],
                "original_length": named["original_length"]}, named["caption"]

    @staticmethod
    def rollout_values(prompts):
        return {**prompts, "encoder_hidden_states": prompts["prompt_embeds"]}

    @staticmethod
    def condition(prompts, rollout_extra, i, n, args):
        length = int(prompts["original_length"][i])
        lengths = rollout_extra[i]   # all_txt_seq_lens: this sample's text lengths, as the rollout used them
        lengths = lengths.reshape(-1).tolist() if torch.is_tensor(lengths) else lengths
        lengths = list(lengths) if isinstance(lengths, (list, tuple)) else [int(lengths)]
        return {"encoder_hidden_states": _stacked(prompts["prompt_embeds"][:, :length], i, n),
                "prompt_attention_masks": _stacked(prompts["prompt_attention_masks"][:, :length], i, n),
                "txt_seq_lens": lengths * n, "img_shapes": [[(1, args.h // 16, args.w // 16)]] * n}


FAMILIES = {"flux": FluxUpstream, "flux_lora": FluxUpstream, "qwenimage": QwenImageUpstream}
