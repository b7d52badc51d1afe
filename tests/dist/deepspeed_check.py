"""Check "deepspeed" of run_checks.py (two ranks): one optimizer step of the policy update under
DeepSpeed ZeRO, each rank backpropagating half of a batch, must leave the weights of a
single-process AdamW step on the whole batch (gradients averaged over ranks, as the engine does).
Flags: the trainer's (with --engine deepspeed) and --apply_jagg with --jagg_* flags.
"""
import dataclasses

import torch
import torch.distributed as dist

from dancegrpo import train_grpo_flux, trainer
from dancegrpo.engines import plain_engine

from fsdp_grad_check import check_args, same_data_on_every_rank


def check(cache_dir, workdir, flags):
    args = check_args(cache_dir, workdir, flags)
    ctx = trainer.setup(args, train_grpo_flux.FAMILY(args))
    assert ctx.engine.name == "deepspeed", "expected --engine deepspeed"
    rank, world = dist.get_rank(), dist.get_world_size()
    ref_model, _ = ctx.family.load(args, ctx.device)   # same weights, no engine
    if args.use_lora:
        from dancegrpo.adapters.lora import add_lora
        add_lora(ref_model, args, ctx.seed)
    cond, rollout, adv, steps, num_train = same_data_on_every_rank(ctx, ref_model, num_prompts=2)
    normaliser = args.gradient_accumulation_steps * num_train
    update = train_grpo_flux.policy_update
    n = adv.numel()
    mine = torch.arange(rank * n // world, (rank + 1) * n // world)
    ctx.transformer.train()
    stats = trainer.accumulate_policy_gradient(ctx, rollout, cond, adv, mine, steps, normaliser, update)
    grad_norm = trainer.optimizer_step(ctx, "")
    got = ctx.engine.full_state(trainable_only=True)

    ref_engine = plain_engine(ref_model, args)   # one process's AdamW, no engine of DeepSpeed's
    ref_ctx = dataclasses.replace(ctx, transformer=ref_model, engine=ref_engine)
    ref_model.train()
    trainer.accumulate_policy_gradient(ref_ctx, rollout, cond, adv, torch.arange(n), steps, normaliser * world, update)
    ref_norm = ref_engine.optimizer_step(lambda norm: None)
    ref = {k: p.detach() for k, p in ref_model.named_parameters() if p.requires_grad}
    assert set(ref) == set(got), sorted(set(ref) ^ set(got))[:4]
    err = max((got[k] - ref[k]).abs().max().item() for k in ref)
    moved = max((ref[k] - dict(ctx.family.load(args, ctx.device)[0].named_parameters()).get(k, ref[k])).abs().max().item()
                for k in ref)
    counts = ctx.counter.as_dict()
    ctx.counter.remove()
    return {"max_abs_err": err, "moved": moved, "grad_norm": grad_norm, "ref_grad_norm": ref_norm,
            "world_size": world, "stage": ctx.engine.stage, "jagg_groups": stats.jagg_groups,
            "num_trained_tensors": len(ref), **counts}
