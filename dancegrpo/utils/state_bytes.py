"""Bytes per rank of the training state (parameters, gradients, optimizer state) for each way of
fitting a model: analytic, from parameter counts and dtypes, so a user can choose before renting
GPUs. Activations are not included (they depend on resolution, checkpointing and the update form;
the trainer measures them as activation_peak_mb).

Setups (N ranks, P parameters, T of them trainable, AdamW with two moments):
- fsdp       FSDP FULL_SHARD, as upstream: parameters, gradients and moments sharded over N, all in
             the FSDP parameter dtype (fp32 master weights, or bf16 as upstream's Qwen-Image);
- lora       the same, but only the adapter (T << P) has gradients and optimizer state;
- zero2      DeepSpeed ZeRO-2: parameters replicated, gradients sharded (both in the engine's dtype:
             2 bytes in bf16, 4 in fp32, as a CPU run is), optimizer sharded: an fp32 master copy of
             the partition (ZeRO keeps one in fp32 too) + two fp32 moments (12 bytes per trainable);
- zero3      DeepSpeed ZeRO-3: everything sharded, optimizer as ZeRO-2;
- zero0/1    DeepSpeed without sharding / with the optimizer sharded only (ZeRO-0 in fp32 steps the
             parameters themselves: two moments, 8 bytes per trainable).
With LoRA under DeepSpeed, T is the adapter.

    python -m dancegrpo.utils.state_bytes       # the table in docs/lora_deepspeed_memory.md: Flux (12B) and Qwen-Image (20B) on 8 GPUs
"""
from .command_line import CommandParser

GIB = 2 ** 30
SETUPS = ("fsdp", "lora", "zero0", "zero1", "zero2", "zero3")
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def per_rank_bytes(setup, num_params, num_trainable, world_size, weight_type="fp32"):
    """{"params", "grads", "optimizer", "total"} bytes held by one rank."""
    n = max(1, world_size)
    b = DTYPE_BYTES[weight_type]
    adam = 8 if (setup == "zero0" and weight_type == "fp32") else 12   # + the fp32 master copy, bar ZeRO-0 fp32
    if setup in ("fsdp", "lora"):
        out = dict(params=num_params * b / n, grads=num_trainable * b / n, optimizer=2 * num_trainable * b / n)
    elif setup in ("zero0", "zero1"):   # data parallel; ZeRO-1 shards the optimizer only
        out = dict(params=num_params * b, grads=num_trainable * b,
                   optimizer=adam * num_trainable / (n if setup == "zero1" else 1))
    elif setup == "zero2":
        out = dict(params=num_params * b, grads=num_trainable * b / n, optimizer=adam * num_trainable / n)
    elif setup == "zero3":
        out = dict(params=num_params * b / n, grads=num_trainable * b / n, optimizer=adam * num_trainable / n)
    else:
        raise ValueError(f"unknown setup {setup!r}; one of {SETUPS}")
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def _size(n):
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2 ** 20:.3f} MiB"


def describe_bytes(b):
    return (f"params {_size(b['params'])} + grads {_size(b['grads'])} + optimizer {_size(b['optimizer'])} = "
            f"{_size(b['total'])} per rank (analytic; activations not included)")


# The real models' configs (diffusers), counted on the meta device; LoRA as upstream's recipe.
REAL_MODELS = {
    "Flux (FLUX.1-dev)": ("FluxTransformer2DModel", dict(
        patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
        num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
        axes_dims_rope=(16, 56, 56)), "fp32"),
    "Qwen-Image": ("QwenImageTransformer2DModel", dict(
        patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
        num_attention_heads=24, joint_attention_dim=3584, axes_dims_rope=(16, 56, 56)), "bf16"),
}


def count_real_model(cls_name, config, lora_rank=128, lora_alpha=256,
                     targets=("to_q", "to_k", "to_v", "to_out.0")):
    """(parameters, LoRA adapter parameters) of a real config, built on the meta device (no memory)."""
    import diffusers
    import torch
    from peft import LoraConfig
    with torch.device("meta"):
        model = getattr(diffusers, cls_name)(**config)
        total = sum(p.numel() for p in model.parameters())
        model.requires_grad_(False)
        model.add_adapter(LoraConfig(r=lora_rank, lora_alpha=lora_alpha, target_modules=list(targets)))
        adapter = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return total, adapter


def table(world_size=8):
    lines = [f"| model | setup | params / GPU | grads / GPU | optimizer / GPU | total / GPU ({world_size} GPUs) |",
             "|---|---|---|---|---|---|"]
    for name, (cls_name, config, weight_type) in REAL_MODELS.items():
        total, adapter = count_real_model(cls_name, config)
        for setup in ("fsdp", "lora", "zero2", "zero3"):
            trainable = adapter if setup == "lora" else total
            dtype = "bf16" if setup.startswith("zero") else weight_type   # DeepSpeed on GPU: bf16, as labelled
            b = per_rank_bytes(setup, total + (adapter if setup == "lora" else 0), trainable, world_size, dtype)
            label = {"fsdp": f"FSDP full fine-tune ({weight_type})", "lora": f"FSDP + LoRA r128 ({weight_type} base, "
                     f"{adapter / 1e6:.0f}M trainable)", "zero2": "DeepSpeed ZeRO-2 (bf16)",
                     "zero3": "DeepSpeed ZeRO-3 (bf16)"}[setup]
            lines.append(f"| {name}, {total / 1e9:.2f}B | {label} | {b['params'] / GIB:.1f} GiB | "
                         f"{b['grads'] / GIB:.1f} GiB | {b['optimizer'] / GIB:.1f} GiB | {b['total'] / GIB:.1f} GiB |")
    return "\n".join(lines)


def main(argv=None):
    p = CommandParser(prog="python -m dancegrpo.utils.state_bytes", description=__doc__.splitlines()[0])
    p.add_argument("--world_size", type=int, default=8)
    print(table(p.parse_args(argv).world_size))


if __name__ == "__main__":
    main()
