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


# ---------------------------------------------------------------- the video trainers (HunyuanVideo, SkyReels)

VIDEO_TEXT_DIM, VIDEO_TEXT_TOKENS = 24, 6   # encoder_hidden_states [1 + tokens, dim]: row 0 the pooled text


def video_parser(kind):
    """The flags of upstream's HunyuanVideo ("hunyuan") or SkyReels ("skyreels") parser that their
    train_one_step and rollout read, with upstream's defaults (no --clip_range / --adv_clip_max: their
    loops hold those constants), plus --cache_dir / --output_dir as the other stand-ins have."""
    import argparse
    parser = argparse.ArgumentParser()
    parser.add_argument("--cache_dir", default=None)
    parser.add_argument("--output_dir", required=True)
    for name, kind_, default in (("h", int, 32), ("w", int, 32), ("t", int, 5), ("sampling_steps", int, 8),
                                 ("eta", float, 0.3), ("fps", int, 8), ("num_generations", int, 16),
                                 ("timestep_fraction", float, 1.0), ("shift", float, 1.0),
                                 ("train_batch_size", int, 1), ("gradient_accumulation_steps", int, 1),
                                 ("learning_rate", float, 1e-5), ("max_grad_norm", float, 2.0),
                                 ("max_train_steps", int, 1), ("seed", int, 42)):
        parser.add_argument(f"--{name}", type=kind_, default=default)
    parser.add_argument("--use_group", action="store_true")
    parser.add_argument("--use_videoalign", action="store_true")
    if kind == "hunyuan":
        parser.add_argument("--bestofn", type=int, default=8)
        parser.add_argument("--vq_coef", type=float, default=1.0)
        parser.add_argument("--mq_coef", type=float, default=0.0)
        parser.add_argument("--use_same_noise", action="store_true")
    else:
        parser.add_argument("--cfg_infer", type=float, default=1.0)
        parser.add_argument("--init_same_noise", action="store_true")
    return parser


def load_video_transformer(kind, dtype=torch.float32, seed=0):
    """A tiny stand-in of fastvideo's HunyuanVideoTransformer3DModel (SkyReels: 32 input channels, the
    noisy latents then the first frame's), with FSDP's clip_grad_norm_ method."""
    from fastvideo.models.hunyuan_hf.modeling_hunyuan import HunyuanVideoTransformer3DModel
    model = HunyuanVideoTransformer3DModel(in_channels=16 if kind == "hunyuan" else 32, text_dim=VIDEO_TEXT_DIM,
                                           seed=seed)
    return ClipGradModule(model.to(dtype))


def video_prompts(batch_size, dtype=torch.float32, seed=11):
    """Endless (encoder_hidden_states [P, 1 + L, D], encoder_attention_mask [P, 1 + L], captions) batches of
    fixed embeddings, each prompt with its own count of masked-out tokens."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randn(4, 1 + VIDEO_TEXT_TOKENS, VIDEO_TEXT_DIM, generator=g, dtype=torch.float64).to(dtype)
    masks = torch.ones(4, 1 + VIDEO_TEXT_TOKENS, dtype=torch.long)
    for row in range(4):
        masks[row, VIDEO_TEXT_TOKENS - row:] = 0
    start = 0
    while True:
        rows = [(start + i) % len(prompts) for i in range(batch_size)]
        start += batch_size
        yield prompts[rows], masks[rows], [f"a video of prompt {r}" for r in rows]


def empty_prompt(dtype=torch.float32, seed=13):
    """The empty prompt as SkyReels' main loads it: [1 + L, D] and [1 + L], no batch dim."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(1 + VIDEO_TEXT_TOKENS, dtype=torch.long)
    mask[:2] = 1
    return torch.randn(1 + VIDEO_TEXT_TOKENS, VIDEO_TEXT_DIM, generator=g, dtype=torch.float64).to(dtype), mask


class VideoAlign:
    """A stand-in of the VideoAlign inferencer: reward([video], [prompt], use_norm=True) -> [{"VQ", "MQ",
    ...}] of the decoded video (here the final x0 itself: the stand-ins write no mp4)."""

    def reward(self, videos, prompts, use_norm=True):
        x = videos[0].double()
        return [{"VQ": -(x - 0.25).pow(2).mean().item(), "MQ": (x.mean() - x.std()).item(), "Overall": 0.0}]


class FirstFramePipe:
    """A stand-in of SkyReels' FluxPipeline: one deterministic image in [-1, 1] per prompt."""

    def __call__(self, prompt, height, width, guidance_scale, num_inference_steps, max_sequence_length):
        g = torch.Generator().manual_seed(sum(map(ord, prompt)))
        return torch.rand(1, 3, height, width, generator=g, dtype=torch.float64) * 2 - 1

    def to(self, device):
        return self


class FirstFrameVAE:
    """A stand-in of the video VAE's encode: 8x8 average pooling, a fixed channel map to 16, plus a
    sample of the latent distribution drawn from the global generator."""

    def __init__(self, seed=17):
        g = torch.Generator().manual_seed(seed)
        self.weight = torch.randn(16, 3, generator=g, dtype=torch.float64)

    def encode(self, image):
        from types import SimpleNamespace
        pooled = torch.nn.functional.avg_pool3d(image, (1, 8, 8))   # [1, 3, 1, h/8, w/8]
        mean = torch.einsum("oc,bcthw->bothw", self.weight.to(pooled.dtype), pooled)
        sample = lambda: mean + 0.1 * torch.randn_like(mean)   # noqa: E731
        return SimpleNamespace(latent_dist=SimpleNamespace(sample=sample))


def video_run_objects(kind, args, dtype):
    """(device, transformer, optimizer, lr_scheduler, prompt batches) as upstream's video mains build them."""
    torch.manual_seed(args.seed)
    init_single_process_group()
    transformer = load_video_transformer(kind, dtype)
    optimizer = torch.optim.AdamW(transformer.parameters(), lr=args.learning_rate)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    os.makedirs(args.output_dir, exist_ok=True)
    return torch.device("cpu"), transformer, optimizer, lr_scheduler, video_prompts(args.train_batch_size, dtype)


# ---------------------------------------------------------------- the Stable Diffusion trainer (train_grpo_sd.py)

SD_TEXT_DIM, SD_TEXT_TOKENS = 16, 4


def tiny_sd_pipeline(dtype=torch.float64, clip_sample=False, seed=0):
    """What StableDiffusionPipeline.from_pretrained("./data/stable-diffusion-v1-4") gives upstream, tiny: a
    UNet2DConditionModel (4 latent channels, 8 x 8), a VAE, a PNDM scheduler whose config says clip_sample;
    no text encoder (the prompts' embeddings: sd_prompt_embeddings)."""
    from diffusers import AutoencoderKL, PNDMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    default = torch.get_default_dtype()
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        torch.set_default_dtype(dtype)
        try:
            unet = UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
                                        block_out_channels=(8, 16), norm_num_groups=4,
                                        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
                                        cross_attention_dim=SD_TEXT_DIM, attention_head_dim=2)
            vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                                up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(4, 8),
                                layers_per_block=1, latent_channels=4, norm_num_groups=4)
        finally:
            torch.set_default_dtype(default)
    scheduler = PNDMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                              num_train_timesteps=1000, skip_prk_steps=True, steps_offset=1)
    pipeline = StableDiffusionPipeline(vae=vae, text_encoder=None, tokenizer=None, unet=unet, scheduler=scheduler,
                                       safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    # the constructor turns clip_sample off in the scheduler's config: set it as the model folder says
    pipeline.scheduler.register_to_config(clip_sample=clip_sample)
    return pipeline


def sd_prompt_embeddings(prompts, dtype=torch.float64):
    """The frozen text encoder's output for each prompt: fixed embeddings drawn from the prompt's text
    (the empty prompt too), [len(prompts), tokens, dim]."""
    out = []
    for prompt in prompts:
        g = torch.Generator().manual_seed(sum(map(ord, prompt)) + 7)
        out.append(torch.randn(SD_TEXT_TOKENS, SD_TEXT_DIM, generator=g, dtype=torch.float64))
    return torch.stack(out).to(dtype)


def sd_reward(images, prompts):
    """A cheap deterministic reward of the decoded images (upstream: an aesthetic / HPS model)."""
    return -(images.float() - 0.2).pow(2).mean(dim=(1, 2, 3))
