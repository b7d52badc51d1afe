"""Tiny text encoders and tokenizers, built offline and saved in the diffusers folder layout."""
import os

import torch
from tokenizers import Regex, Tokenizer, models, pre_tokenizers

from dancegrpo import presets

QWEN_TEMPLATE_WORDS = ("system user assistant Describe the image by detailing color shape size texture quantity "
                       "text spatial relationships of objects and background")
SPECIALS = ["<pad>", "<unk>", "</s>", "<s>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]


def word_tokenizer(folder, model_max_length, pad_token="<pad>", eos_token=None):
    """A word-level tokenizer whose vocabulary covers the bundled prompts and Qwen's chat
    template; newlines and punctuation are tokens of their own, like Qwen's BPE, so the
    template prefix is exactly the 34 tokens QwenImagePipeline drops."""
    from transformers import PreTrainedTokenizerFast
    words = sorted({w for p in presets.bundled_prompts(1000) for w in p.replace(",", " ").split()}
                   | set(QWEN_TEMPLATE_WORDS.split()))
    vocab = {t: i for i, t in enumerate(SPECIALS + [",", ":", ".", "\n"] + words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\n"), "isolated"),
        pre_tokenizers.Split(Regex(r"[ \t]+"), "removed"),
        pre_tokenizers.Punctuation("isolated"),
    ])
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=pad_token, unk_token="<unk>",
                                   eos_token=eos_token, model_max_length=model_max_length)
    fast.save_pretrained(folder)
    return len(vocab)


def build_qwen_text_folder(root, hidden=32, seed=0):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    vocab = word_tokenizer(os.path.join(root, "tokenizer"), 2048, pad_token="<|endoftext|>")
    torch.manual_seed(seed)
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                         bos_token_id=3, eos_token_id=2, pad_token_id=6,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=hidden,
                           fullatt_block_indexes=[0]),
        vocab_size=vocab, bos_token_id=3, eos_token_id=2, pad_token_id=6)
    Qwen2_5_VLForConditionalGeneration(config).save_pretrained(os.path.join(root, "text_encoder"))
    return root


def build_flux_text_folder(root, hidden=32, seed=0):
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel
    vocab = word_tokenizer(os.path.join(root, "tokenizer"), 77, eos_token="</s>")
    word_tokenizer(os.path.join(root, "tokenizer_2"), 512, eos_token="</s>")
    torch.manual_seed(seed)
    CLIPTextModel(CLIPTextConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                 num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=77,
                                 projection_dim=hidden, bos_token_id=3, eos_token_id=2, pad_token_id=0)
                  ).save_pretrained(os.path.join(root, "text_encoder"))
    T5EncoderModel(T5Config(vocab_size=vocab, d_model=hidden, d_kv=8, d_ff=2 * hidden, num_layers=1, num_heads=2,
                            pad_token_id=0, eos_token_id=2)).save_pretrained(os.path.join(root, "text_encoder_2"))
    return root
