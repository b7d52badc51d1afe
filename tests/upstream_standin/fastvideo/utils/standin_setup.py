"""What the stand-in trainers need besides upstream's own functions: tiny models from this
repository's presets, a one-process gloo group, upstream-shaped loaders and a cheap reward.

Upstream's `main` builds these from real weights on CUDA with nccl and FSDP; the stand-in builds
them on CPU so that `jagg_patch.upstream` can be tested without upstream's code."""
import os
import tempfile

import torch
import torch.distributed as dist

from dancegrpo.utils.data import PromptEmbeddingDataset, collate_prompts
from dancegrpo.models.flux import FluxFamily
from dancegrpo.models.qwenimage import QwenImageFamily
from dancegrpo.presets import materialize_preset

FAMILIES = {"flux": FluxFamily, "qwenimage": QwenImageFamily}
TRANSFORMERS = {"flux": "FluxTransformer2DModel", "qwenimage": "QwenImageTransformer2DModel"}


class ClipGradModule(torch.nn.Module):
    """A diffusers transformer with FSDP's `clip_grad_norm_` method, which upstream calls on its
    FSDP-wrapped transformer."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def clip_grad_norm_(self, max_norm):
        return torch.nn.utils.clip_grad_norm_([p for p in self.parameters() if p.requires_grad], max_norm)


def init_single_process_group():
    """A one-rank gloo group (upstream: nccl over torchrun's ranks), unless one exists."""
    if not dist.is_initialized():
        store = tempfile.mktemp(prefix="standin_store_")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)


def load_transformer(family, cache_dir, dtype=torch.float32):
    import diffusers
    root = materialize_preset(family, "tiny", cache_dir)
    model = getattr(diffusers, TRANSFORMERS[family]).from_pretrained(root, subfolder="transformer", torch_dtype=dtype)
    return ClipGradModule(model), os.path.join(root, "data", "prompts.json")


def prompt_batches(family, json_path, batch_size, dtype=torch.float32):
    """Endless batches in upstream's loader order: Flux (encoder_hidden_states, pooled_prompt_embeds,
    text_ids, captions); Qwen-Image (prompt_embeds, prompt_attention_masks, captions, original_length)."""
    dataset = PromptEmbeddingDataset(json_path, FAMILIES[family].embedding_fields)
    start = 0
    while True:
        rows = [(start + i) % len(dataset) for i in range(batch_size)]
        start += batch_size
        batch = collate_prompts([dataset[i] for i in rows])
        captions = list(batch["caption"])
        if family == "flux":
            yield (batch["encoder_hidden_states"].to(dtype), batch["pooled_prompt_embeds"].to(dtype),
                   batch["text_ids"].to(dtype), captions)
        else:
            mask = batch["encoder_hidden_states_mask"]
            yield batch["encoder_hidden_states"].to(dtype), mask, captions, mask.sum(dim=1)


def latent_reward(x0, captions):
    """A cheap deterministic reward of the final x0 (upstream: HPS of the decoded image)."""
    return -(x0.float() - 0.25).pow(2).mean(dim=tuple(range(1, x0.ndim)))


def qwen_text_kwargs(transformer, txt_seq_lens):
    """txt_seq_lens as upstream passes it, where this diffusers' QwenImageTransformer2DModel still
    takes it (it was dropped in 0.36)."""
    import inspect
    model = getattr(transformer, "module", transformer)
    return {"txt_seq_lens": txt_seq_lens} if "txt_seq_lens" in inspect.signature(model.forward).parameters else {}


def standin_parser():
    """The stand-in trainers' flags: upstream's names and meanings, plus --cache_dir for the presets."""
    import argparse
    parser = argparse.ArgumentParser()
    parser.add_argument("--cache_dir", required=True)
    parser.add_argument("--output_dir", required=True)
    for name, kind, default in (("h", int, 64), ("w", int, 64), ("t", int, 2), ("condition_h", int, 48),
                                ("condition_w", int, 32), ("cfg_infer", float, 5.0),
                                ("sampling_steps", int, 8), ("eta", float, 0.3),
                                ("shift", float, 3.0), ("seed", int, 42), ("train_batch_size", int, 1),
                                ("num_generations", int, 4), ("timestep_fraction", float, 0.6),
                                ("clip_range", float, 1e-4), ("adv_clip_max", float, 5.0),
                                ("gradient_accumulation_steps", int, 4), ("learning_rate", float, 1e-5),
                                ("max_grad_norm", float, 1.0), ("max_train_steps", int, 1), ("lora_rank", int, 4)):
        parser.add_argument(f"--{name}", type=kind, default=default)
    parser.add_argument("--use_group", action="store_true")
    parser.add_argument("--init_same_noise", action="store_true")
    return parser


def standin_run_objects(family, args, dtype, lora=False):
    """(device, transformer, optimizer, lr_scheduler, loader) as upstream's main builds them."""
    torch.manual_seed(args.seed)
    init_single_process_group()
    transformer, data_json = load_transformer(family, args.cache_dir, dtype)
    if lora:
        add_lora(transformer, args.lora_rank).to(dtype)
    optimizer = torch.optim.AdamW([p for p in transformer.parameters() if p.requires_grad], lr=args.learning_rate)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    os.makedirs(args.output_dir, exist_ok=True)
    return torch.device("cpu"), transformer, optimizer, lr_scheduler, prompt_batches(family, data_json,
                                                                                      args.train_batch_size, dtype)


def condition_images(batch_size, height, width, dtype=torch.float32, seed=3):
    """(calculated_height, calculated_width, image_latents) of Qwen-Image-Edit's condition images:
    pixel sizes per prompt and fixed packed latents [B, (height/16)(width/16), 64]."""
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(batch_size, (height // 16) * (width // 16), 64, generator=g, dtype=torch.float64)
    sizes = torch.full((batch_size,), height), torch.full((batch_size,), width)
    return sizes[0], sizes[1], latents.to(dtype)


WAN_TEXT_DIM, WAN_TEXT_TOKENS = 32, 7


def load_wan_transformer(dtype=torch.float32, seed=0):
    """A tiny diffusers WanTransformer3DModel (16 latent channels, patches (1, 2, 2)), drawn from `seed`."""
    from diffusers import WanTransformer3DModel
    default = torch.get_default_dtype()
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        torch.set_default_dtype(dtype)   # built in its dtype: a cast afterwards makes diffusers warn
        try:
            return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                                         in_channels=16, out_channels=16, text_dim=WAN_TEXT_DIM, freq_dim=32,
                                         ffn_dim=32, num_layers=1, rope_max_seq_len=64)
        finally:
            torch.set_default_dtype(default)


def wan_prompts(batch_size, dtype=torch.float32, seed=5):
    """Endless (encoder_hidden_states, negative_prompt_embeds, captions) batches of fixed embeddings."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randn(4, WAN_TEXT_TOKENS, WAN_TEXT_DIM, generator=g, dtype=torch.float64).to(dtype)
    negative = torch.randn(1, WAN_TEXT_TOKENS, WAN_TEXT_DIM, generator=g, dtype=torch.float64).to(dtype)
    start = 0
    while True:
        rows = [(start + i) % len(prompts) for i in range(batch_size)]
        start += batch_size
        yield prompts[rows], negative.expand(batch_size, -1, -1).clone(), [f"a video of prompt {r}" for r in rows]


def wan_run_objects(args, dtype):
    """(device, transformer, optimizer, lr_scheduler, prompt batches) as upstream's Wan main builds them."""
    torch.manual_seed(args.seed)
    init_single_process_group()
    transformer = load_wan_transformer(dtype)
    optimizer = torch.optim.AdamW(transformer.parameters(), lr=args.learning_rate)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    os.makedirs(args.output_dir, exist_ok=True)
    return torch.device("cpu"), transformer, optimizer, lr_scheduler, wan_prompts(args.train_batch_size, dtype)


def add_lora(transformer, rank, seed=0):
    """A peft LoRA adapter on the attention projections, as upstream's LoRA trainer; its B matrices
    are drawn non-zero so that the adapter changes the output from the first step on."""
    from peft import LoraConfig
    model = transformer.module
    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=rank, lora_alpha=2 * rank, init_lora_weights=True,
                                 target_modules=["to_k", "to_q", "to_v", "to_out.0"]))
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.1)
    return transformer


def finish_run():
    dist.barrier()
    dist.destroy_process_group()
