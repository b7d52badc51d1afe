"""Flux's prompt-embedding files, in upstream's layout: prompt_embed/ (T5 tokens), pooled_prompt_embeds/
(CLIP pooled) and text_ids/ (one [3] row, as upstream saves it), named in the JSON items."""
import os

import torch

from ..preset_defaults import seeded_randn


def save_embeddings(root, entries):
    """[(caption, prompt_embed [T, D], pooled [P])] -> the files under root; returns the JSON items."""
    items = []
    for sub in ("prompt_embed", "pooled_prompt_embeds", "text_ids"):
        os.makedirs(os.path.join(root, sub), exist_ok=True)
    for i, (caption, embed, pooled) in enumerate(entries):
        name = f"{i:05d}.pt"
        torch.save(embed, os.path.join(root, "prompt_embed", name))
        torch.save(pooled, os.path.join(root, "pooled_prompt_embeds", name))
        torch.save(torch.zeros(3), os.path.join(root, "text_ids", name))
        items.append({"caption": caption, "prompt_embed_path": name, "pooled_prompt_embeds_path": name,
                      "text_ids": name})
    return items


def write_embeddings(root, prompts, text):
    """Fixed random T5-like / CLIP-pooled embeddings, one file per prompt (a preset's prompts)."""
    return save_embeddings(root, [(p, seeded_randn((text["tokens"], text["dim"]), 1000 + i),
                                   seeded_randn((text["pooled_dim"],), 2000 + i)) for i, p in enumerate(prompts)])
