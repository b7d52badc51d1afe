"""Qwen-Image prompt embeddings: `python -m dancegrpo.preprocess.qwenimage --model_path data/qwenimage --prompt_dir prompts.txt`.

Uses diffusers' QwenImagePipeline.encode_prompt (chat template, Qwen2.5-VL last
hidden state, template tokens dropped) with text_encoder/ and tokenizer/ at
--model_path; the transformer and VAE are not loaded. Per prompt, as upstream:
prompt_embed [T, 3584] zero-padded to T = --max_sequence_length (1024),
prompt_attention_mask [T] (1 = real token), and "original_length" in the JSON.
"""
DESCRIPTION = __doc__.splitlines()[0]
SUBFOLDERS = {
    "prompt_embeds": ("prompt_embed_path", "prompt_embed"),
    "prompt_attention_mask": ("prompt_attention_mask", "prompt_attention_mask"),
}
COMPONENTS = ("text_encoder", "tokenizer")
HINT = ("download Qwen-Image there (e.g. `huggingface-cli download Qwen/Qwen-Image --local-dir data/qwenimage`); "
        "only text_encoder/ and tokenizer/ are read")


class QwenImageEncoder:
    """The writer's model part (dancegrpo.preprocess.common.run drives it)."""
    description = DESCRIPTION
    subfolders = SUBFOLDERS
    components, hint = COMPONENTS, HINT
    default_max_sequence_length = 1024

    @staticmethod
    def check_args(args):
        if not 1 <= args.max_sequence_length <= 1024:
            return "--max_sequence_length must be in [1, 1024] (QwenImagePipeline's limit)"
        return None

    @staticmethod
    def load(args, device, dtype):
        from diffusers import QwenImagePipeline
        from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration
        path = args.model_path
        pipe = QwenImagePipeline(
            scheduler=None, vae=None, transformer=None,
            text_encoder=Qwen2_5_VLForConditionalGeneration.from_pretrained(path, subfolder="text_encoder",
                                                                            torch_dtype=dtype),
            tokenizer=AutoTokenizer.from_pretrained(path, subfolder="tokenizer"),
        )
        pipe.text_encoder.to(device).eval()
        return pipe, device

    @staticmethod
    def encode(state, prompts, args):
        import torch   # here: the command line answers --help and a flag error before torch loads
        pipe, device = state
        embeds, mask = pipe.encode_prompt(prompt=prompts, device=device, max_sequence_length=args.max_sequence_length)
        if mask is None:  # the pipeline drops an all-ones mask
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        out, total = [], args.max_sequence_length
        for i in range(len(prompts)):
            n = int(mask[i].sum())
            padded = embeds.new_zeros(total, embeds.shape[-1])
            padded[:n] = embeds[i][mask[i].bool()][:n]
            m = torch.zeros(total, dtype=torch.long)
            m[:n] = 1
            out.append({"prompt_embeds": padded, "prompt_attention_mask": m})
        return out

    @staticmethod
    def index_fields(paths):
        import torch
        mask = torch.load(paths["prompt_attention_mask"], map_location="cpu", weights_only=True)
        return {"original_length": int(mask.sum())}


ENCODER = QwenImageEncoder
