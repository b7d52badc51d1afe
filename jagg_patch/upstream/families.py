"""What differs between upstream's trainers, as the restated train_one_step needs it: where a
step's prompts come from, whether the step zeroes the gradients first, the conditioning arguments
of grpo_one_step for one sample (stacked n times for a batched forward), how many rows one
transformer call holds per sample, and how the gradient is clipped.

A registry: the family name (jagg_patch.upstream.fingerprint.family_of) -> its rules.
"""
import torch

from ..cli import upstream_output_bytes


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
    """fastvideo/train_grpo_flux.py and train_grpo_flux_lora.py: prompts from next(loader); the step
    zeroes the gradients first; the clip is FSDP's transformer.clip_grad_norm_."""
    zero_grad_first = True
    needs_group = False
    plan_note = None   # a line the start-up plan adds for this family
    # What the plan says the kept rollout outputs cost per sample (None: not sized by the flags alone).
    output_bytes = staticmethod(upstream_output_bytes)

    @staticmethod
    def alpha_timesteps(timesteps):
        """The timesteps JAGG's alpha is taken from, as the model gets them: int(sigma * 1000) / 1000
        (`timesteps`: the long integers), the image trainers' float32 values."""
        return timesteps / 1000

    @staticmethod
    def prompts(named):
        encoder_hidden_states, pooled_prompt_embeds, text_ids, caption = next(named["loader"])
        return {"encoder_hidden_states": encoder_hidden_states, "pooled_prompt_embeds": pooled_prompt_embeds,
                "text_ids": text_ids}, caption

    @staticmethod
    def check(prompts):
        """Refuse, before the rollout, prompt tensors the restated step would pass on wrongly."""

    @staticmethod
    def rollout_values(prompts):
        return prompts

    @staticmethod
    def condition(prompts, extra, i, n, args):
        # text_ids and image_ids stay one row: grpo_one_step repeats text_ids over the tokens and
        # squeezes image_ids, which are the same for every sample (all_image_ids, extra[0]).
        return {"encoder_hidden_states": _stacked(prompts["encoder_hidden_states"], i, n),
                "pooled_prompt_embeds": _stacked(prompts["pooled_prompt_embeds"], i, n),
                "text_ids": prompts["text_ids"][i:i + 1], "image_ids": extra[0][i:i + 1]}

    @staticmethod
    def call_rows(args):
        """Rows one transformer call holds per sample (2 for a classifier-free-guided call)."""
        return 1

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


class QwenImageUpstream(FluxUpstream):
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
    def condition(prompts, extra, i, n, args):
        length = int(prompts["original_length"][i])
        lengths = extra[0][i]   # all_txt_seq_lens: this sample's text lengths, as the rollout used them
        lengths = lengths.reshape(-1).tolist() if torch.is_tensor(lengths) else lengths
        lengths = list(lengths) if isinstance(lengths, (list, tuple)) else [int(lengths)]
        return {"encoder_hidden_states": _stacked(prompts["prompt_embeds"][:, :length], i, n),
                "prompt_attention_masks": _stacked(prompts["prompt_attention_masks"][:, :length], i, n),
                "txt_seq_lens": lengths * n, "img_shapes": [[(1, args.h // 16, args.w // 16)]] * n}


class QwenImageEditUpstream(QwenImageUpstream):
    """fastvideo/train_grpo_qwenimage_edit.py: Qwen-Image's step plus a condition image. The model
    input is the latents followed by the condition's latents (all_image_latents, the rollout's 6th
    value) along the tokens, and the output holds both: grpo_one_step cuts it back, so the recorded
    output is the whole one. img_shapes pairs the target's size with the FIRST sample's condition
    size, for every sample, as upstream's step passes it."""
    # The condition image's tokens are in every output; their count is the data's, not the flags'.
    output_bytes = staticmethod(lambda args: None)

    @staticmethod
    def prompts(named):
        prompts, caption = QwenImageUpstream.prompts(named)
        return {**prompts, **{name: named[name] for name in ("calculated_height", "calculated_width",
                                                             "image_latents")}}, caption

    @staticmethod
    def condition(prompts, extra, i, n, args):
        values = QwenImageUpstream.condition(prompts, extra, i, n, args)
        condition_size = (1, int(prompts["calculated_height"][0]) // 16, int(prompts["calculated_width"][0]) // 16)
        return {**values, "img_shapes": [[(1, args.h // 16, args.w // 16), condition_size]] * n,
                "image_latents": _stacked(extra[1], i, n)}


def _is_fsdp(module):
    from torch.distributed.fsdp import FullyShardedDataParallel
    return isinstance(module, FullyShardedDataParallel)


class WanUpstream(FluxUpstream):
    """fastvideo/train_grpo_wan_2_1.py (text to video): the prompt and the negative prompt are
    arguments; the step zeroes the gradients first and runs without --use_group too. With
    --cfg_infer > 1 one transformer call holds the n conditional rows, then the n unconditional ones.
    The clip is torch.nn.utils.clip_grad_norm_ over transformer.parameters(): under FSDP1 each rank
    clips by its own shard's norm (upstream's, reproduced)."""
    # Video latents: their frame count is not among the flags the adapter reads.
    output_bytes = staticmethod(lambda args: None)
    plan_note = ("  timestep alpha: from the integers int(sigma * 1000) Wan's model gets, in float64 (the image "
                 "trainers' int(sigma * 1000) / 1000 in float32 has the same ratios to float32 rounding)")

    @staticmethod
    def alpha_timesteps(timesteps):
        """The integers the model gets, in float64: alpha's ratios exact."""
        return timesteps.to(torch.float64)

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
    def condition(prompts, extra, i, n, args):
        return {"encoder_hidden_states": _stacked(prompts["encoder_hidden_states"], i, n),
                "negative_prompt_embeds": _stacked(prompts["negative_prompt_embeds"], i, n)}

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
        if not _is_fsdp(transformer):
            return None
        return ("jagg_patch.upstream: upstream's Wan trainer clips with torch.nn.utils.clip_grad_norm_ on the "
                "FSDP transformer's parameters, so each rank clips by the norm of its own shard, not the full "
                "gradient's; reproduced as upstream does it (docs/upstream_differences.md)")


FAMILIES = {"flux": FluxUpstream, "qwenimage": QwenImageUpstream, "qwenimage_edit": QwenImageEditUpstream,
            "wan": WanUpstream}
