"""Flux prompt embeddings: `python -m dancegrpo.preprocess.flux --model_path data/flux --prompt_dir prompts.txt`.

Uses diffusers' FluxPipeline.encode_prompt with the CLIP (text_encoder/, tokenizer/)
and T5 (text_encoder_2/, tokenizer_2/) components at --model_path; the
transformer and VAE are not loaded. Per prompt: prompt_embed [T, 4096] (T5),
pooled_prompt_embeds [768] (CLIP), text_ids [3]. T = --max_sequence_length (512).

text_ids is saved as one [3] row, as upstream's preprocessing does: every row of Flux's text
position ids is the same, and upstream's trainer repeats the row to [T, 3]. So these folders
train with upstream's trainer as well as with this one (which reads [3] and [T, 3] files).
"""
DESCRIPTION = __doc__.splitlines()[0]
SUBFOLDERS = {
    "prompt_embeds": ("prompt_embed_path", "prompt_embed"),
    "pooled_prompt_embeds": ("pooled_prompt_embeds_path", "pooled_prompt_embeds"),
    "text_ids": ("text_ids", "text_ids"),
}
COMPONENTS = ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")
HINT = ("download FLUX.1-dev there (e.g. `huggingface-cli download black-forest-labs/FLUX.1-dev "
        "--local-dir data/flux`); only text_encoder/, tokenizer/, text_encoder_2/, tokenizer_2/ are read")


class FluxEncoder:
    """The writer's model part (dancegrpo.preprocess.common.run drives it)."""
    description = DESCRIPTION
    subfolders = SUBFOLDERS
    components, hint = COMPONENTS, HINT
    default_max_sequence_length = 512

    @staticmethod
    def check_args(args):
        return None

    @staticmethod
    def load(args, device, dtype):
        from diffusers import FluxPipeline
        from transformers import AutoTokenizer, CLIPTextModel, T5EncoderModel
        path = args.model_path
        pipe = FluxPipeline(
            scheduler=None, vae=None, transformer=None,
            text_encoder=CLIPTextModel.from_pretrained(path, subfolder="text_encoder", torch_dtype=dtype),
            tokenizer=AutoTokenizer.from_pretrained(path, subfolder="tokenizer"),
            text_encoder_2=T5EncoderModel.from_pretrained(path, subfolder="text_encoder_2", torch_dtype=dtype),
            tokenizer_2=AutoTokenizer.from_pretrained(path, subfolder="tokenizer_2"),
        )
        pipe.text_encoder.to(device).eval()
        pipe.text_encoder_2.to(device).eval()
        return pipe, device

    @staticmethod
    def encode(state, prompts, args):
        pipe, device = state
        embeds, pooled, text_ids = pipe.encode_prompt(prompt=prompts, prompt_2=None, device=device,
                                                      max_sequence_length=args.max_sequence_length)
        return [{"prompt_embeds": embeds[i], "pooled_prompt_embeds": pooled[i], "text_ids": text_ids[0]}
                for i in range(len(prompts))]

    @staticmethod
    def index_fields(paths):
        return {}


ENCODER = FluxEncoder
