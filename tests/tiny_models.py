"""Tiny reward models built by the tests (same architecture families as the real ones), and helpers."""
import os
import types

import numpy as np
import torch
from PIL import Image

# Same layout as open_clip's ViT-H-14 config (ViT image tower, text transformer), scaled down.
TINY_OPEN_CLIP = {"embed_dim": 32,
                  "vision_cfg": {"image_size": 224, "layers": 2, "width": 64, "head_width": 16, "patch_size": 32},
                  "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 64, "heads": 4, "layers": 2}}


def random_images(sizes, seed=0):
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]


def _write_clip_tokenizer_files(folder):
    """A byte-level BPE vocabulary (no merges) in CLIP's format; ids stay below 1000."""
    from transformers import CLIPTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    chars = list(bytes_to_unicode().values())
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({c + "</w>": len(chars) + i for i, c in enumerate(chars)})
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77), vocab


def build_tiny_hf_clip(root, seed=0, with_processor_in_model=False):
    """Write <root>/processor and <root>/model (a tiny transformers CLIPModel); return both paths."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor
    tokenizer, vocab = _write_clip_tokenizer_files(root)
    image_processor = CLIPImageProcessor(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224})
    processor = CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer)
    eos = vocab["<|endoftext|>"]
    config = CLIPConfig(
        text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                         vocab_size=1000, max_position_embeddings=77, bos_token_id=vocab["<|startoftext|>"],
                         eos_token_id=eos, pad_token_id=eos),
        vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                           image_size=224, patch_size=32),
        projection_dim=32, logit_scale_init_value=2.3)
    torch.manual_seed(seed)
    model = CLIPModel(config)
    proc_dir, model_dir = os.path.join(root, "processor"), os.path.join(root, "model")
    processor.save_pretrained(proc_dir)
    model.save_pretrained(model_dir)
    if with_processor_in_model:
        processor.save_pretrained(model_dir)
    return proc_dir, model_dir


def options(**kw):
    return types.SimpleNamespace(**kw)
