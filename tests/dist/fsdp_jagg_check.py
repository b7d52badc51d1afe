"""Check "jagg_core" of run_checks.py (two ranks): the JAGG gradient of FSDP1-wrapped tiny Flux
(gloo, CPU) through jagg_group_backward must equal the single-process JAGG gradient for the same
data, with ONE autograd.backward call per JAGG group; with and without activation checkpointing.
"""
import copy
import types

import torch
import torch.distributed as dist

from dancegrpo.utils.fsdp_util import apply_activation_checkpointing, full_gradients, wrap_fsdp
from dancegrpo.models.flux import FluxFamily
from dancegrpo.algo.sde import flux_step, model_timesteps, sigma_schedule
from dancegrpo.algo.grpo import ppo_clip_loss
from jagg_patch import jagg_group_backward, plan_groups

M, W, N_TRAIN = 2, 4, 6                      # samples per rank, window, trained transitions per sample
SIGMAS = sigma_schedule(8, 3.0)
TIMESTEPS = model_timesteps(SIGMAS)


def tiny_flux():
    from diffusers import FluxTransformer2DModel
    torch.manual_seed(0)
    return FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1,
                                  attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                  pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(4, 4, 8))


def rank_data(rank):
    g = torch.Generator().manual_seed(100 + rank)
    steps = torch.stack([torch.randperm(7, generator=g)[:N_TRAIN].sort().values for _ in range(M)])
    return dict(steps=steps,
                latents=torch.randn(M, 9, 16, 64, generator=g),
                cond={"encoder_hidden_states": torch.randn(M, 8, 32, generator=g),
                      "pooled_prompt_embeds": torch.randn(M, 32, generator=g),
                      "text_ids": torch.zeros(M, 8, 3)},
                ratio_offsets=torch.randn(M, 8, generator=g) * 0.1,
                adv=torch.randn(M, generator=g))


def accumulate(model, family, data, window=W, frac=0.6):
    """The patched update's loop: per group, per-sample timesteps [W, m]. Returns backward calls per group."""
    idx = torch.arange(M)
    calls = []
    for group in plan_groups(range(N_TRAIN), window, frac):
        cols = data["steps"][:, list(group.members)]

        def predict(j):
            return family.predict(model, data["latents"][idx, cols[:, j]], TIMESTEPS[cols[:, j]], data["cond"])

        def step_loss(j, v):
            k = cols[:, j]
            logp = flux_step(v, data["latents"][idx, k], 0.3, SIGMAS, k, prev_sample=data["latents"][idx, k + 1])[2]
            # old log-prob near the current one, so the ratio is O(1) as in training
            old = logp.detach() + data["ratio_offsets"][idx, k]
            return ppo_clip_loss(logp, old, data["adv"], 10.0, 5.0).sum()

        result = jagg_group_backward(predict, step_loss, TIMESTEPS[cols].T, "jagg" if group.jagg else "exact")
        calls.append((group.jagg, result.backward_calls))
    return calls


def check(cache_dir, workdir, flags):
    """Every rank's, per checkpointing setting: the relative gradient error, whether the parameter
    names match, the (jagg, backward calls) of each group and the autograd.backward calls counted."""
    rank, world = dist.get_rank(), dist.get_world_size()
    family = FluxFamily(types.SimpleNamespace(h=64, w=64, guidance=3.5))
    mine = {}
    for checkpointing in (False, True):
        raw = tiny_flux()
        reference = copy.deepcopy(raw)
        for r in range(world):                         # single process, every rank's data
            accumulate(reference, family, rank_data(r))
        ref = {n: p.grad / world for n, p in reference.named_parameters()}   # FSDP averages over ranks

        blocks = family.block_classes(raw)
        model = wrap_fsdp(raw, blocks, torch.device("cpu"))
        if checkpointing:
            apply_activation_checkpointing(model, blocks, 1.0)
        backward_calls = []
        original = torch.autograd.backward
        torch.autograd.backward = lambda *a, **k: (backward_calls.append(1), original(*a, **k))[1]
        try:
            per_group = accumulate(model, family, rank_data(rank))
        finally:
            torch.autograd.backward = original
        got = full_gradients(model)
        num = sum(float((got[n] - ref[n]).norm() ** 2) for n in ref) ** 0.5
        den = sum(float(ref[n].norm() ** 2) for n in ref) ** 0.5
        mine["checkpointing" if checkpointing else "plain"] = dict(
            rel_err=num / den, same_names=set(got) == set(ref), groups=per_group,
            autograd_backward_calls=len(backward_calls))
    ranks = [None] * world
    dist.all_gather_object(ranks, mine)
    return {"world_size": world, "ranks": ranks}
