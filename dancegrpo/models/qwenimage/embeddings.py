"""Qwen-Image's prompt-embedding files, in upstream's layout: prompt_embed/ (zero-padded tokens) and
prompt_attention_mask/ (1 = real token), with the true length as "original_length" in the JSON."""
import os

import torch

from ..preset_defaults import seeded_randn


def save_embeddings(root, entries):
    """[(caption, zero-padded embeds [T, D], mask [T])] -> the files under root; returns the JSON items."""
    items = []
    for sub in ("prompt_embed", "prompt_attention_mask"):
        os.makedirs(os.path.join(root, sub), exist_ok=True)
    for i, (caption, embeds, mask) in enumerate(entries):
        name = f"{i:05d}.pt"
        torch.save(embeds, os.path.join(root, "prompt_embed", name))
        torch.save(mask, os.path.join(root, "prompt_attention_mask", name))
        items.append({"caption": caption, "prompt_embed_path": name, "prompt_attention_mask": name,
                      "original_length": int(mask.sum())})
    return items


def write_embeddings(root, prompts, text):
    """Fixed random Qwen-like embeddings zero-padded to text["tokens"]; true lengths vary between
    text["min_tokens"] and text["tokens"] so padding is exercised."""
    span = text["tokens"] - text["min_tokens"] + 1
    entries = []
    for i, prompt in enumerate(prompts):
        length = text["min_tokens"] + (i * 5) % span
        embeds = torch.zeros(text["tokens"], text["dim"])
        embeds[:length] = seeded_randn((length, text["dim"]), 3000 + i)
        mask = torch.zeros(text["tokens"], dtype=torch.long)
        mask[:length] = 1
        entries.append((prompt, embeds, mask))
    return save_embeddings(root, entries)
