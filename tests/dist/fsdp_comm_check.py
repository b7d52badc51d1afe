"""Check "comm" of run_checks.py (two ranks): FSDP1's (or with --engine fsdp2, FSDP2's) parameter all-gathers and gradient
reduce-scatters per unit during one micro-batch's update, for vanilla and the JAGG backward forms
(with and without rollout reuse); and each form's gradient against the single-process one.
Flags: the trainer's (--jagg_window sets the group size).
"""
import dataclasses

import torch
import torch.distributed as dist

from dancegrpo import train_grpo_flux, trainer
from dancegrpo.utils.fsdp_util import full_gradients
from dancegrpo.algo.grpo import policy_update as vanilla_update
from dancegrpo.algo.rollout import predict_velocity
from jagg_patch import make_policy_update
from jagg_patch.tools.comm_count import count_collectives

from fsdp_grad_check import check_args, same_data_on_every_rank

FORMS = {"vanilla": None, "joint": ("joint", "off"), "split": ("split", "off"), "batched": ("batched", "off"),
         "joint_reuse": ("joint", "on_policy"), "split_reuse": ("split", "on_policy"),
         "batched_reuse": ("batched", "on_policy")}


def check(cache_dir, workdir, flags):
    args = check_args(cache_dir, workdir, flags)
    ctx = trainer.setup(args, train_grpo_flux.FAMILY(args))
    rank, world = dist.get_rank(), dist.get_world_size()
    ref_model, _ = ctx.family.load(args, ctx.device)
    cond, rollout, adv, steps, num_train = same_data_on_every_rank(ctx, ref_model, num_prompts=2)
    n, S = adv.numel(), args.sampling_steps
    ref_ctx = dataclasses.replace(ctx, transformer=ref_model)
    with torch.no_grad():   # the rollout's own outputs, from the unsharded model
        rollout.outputs = torch.stack([predict_velocity(ref_ctx, rollout.latents[:, k],
                                                                ctx.timesteps[k].expand(n), cond)
                                       for k in range(S)], dim=1)
    normaliser = args.gradient_accumulation_steps * num_train
    mine = torch.arange(rank * n // world, (rank + 1) * n // world)
    ref_model.train()
    ctx.transformer.train()
    result = {"world_size": world, "samples_per_rank": len(mine), "forms": {}}
    for form, spec in FORMS.items():
        update = vanilla_update if spec is None else make_policy_update(
            window=args.jagg_window, jagg_frac=1.0, backward=spec[0], reuse=spec[1])
        ctx.transformer.zero_grad(set_to_none=True)
        with count_collectives(ctx.transformer) as counts:
            stats = trainer.accumulate_policy_gradient(ctx, rollout, cond, adv, mine, steps, normaliser, update,
                                                       on_policy=True)
        grads = {k: g * world for k, g in full_gradients(ctx.transformer).items()}
        ref_model.zero_grad(set_to_none=True)
        trainer.accumulate_policy_gradient(ref_ctx, rollout, cond, adv, torch.arange(n), steps, normaliser, update,
                                           on_policy=True)
        ref = {k: p.grad for k, p in ref_model.named_parameters()}
        result["engine"] = args.engine
        num = sum(((grads[k] - ref[k]) ** 2).sum() for k in ref).sqrt().item()
        den = sum((ref[k] ** 2).sum() for k in ref).sqrt().item()
        result["forms"][form] = dict(all_gathers=counts.per_unit(), reduce_scatters=counts.total_reduce_scatters(),
                                     peak_gathered_units=counts.peak_gathered_units,
                                     peak_gathered_bytes=counts.peak_gathered_bytes,
                                     backward_calls=stats.backward_calls, forwards_reused=stats.forwards_reused,
                                     rel_err=num / den)
    ctx.counter.remove()
    return result
