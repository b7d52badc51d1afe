"""Check "monitor" of run_checks.py (two ranks): jagg_patch's monitor on FSDP1-wrapped tiny Flux (gloo,
CPU). Its cosines and relative errors must be those of the FULL gradient: per monitored slot, the
mean over ranks of each rank's sample gradient, computed here in one process on an unwrapped copy;
and the update's own gradient shards must be bit for bit those of the same update without it.
"""
import contextlib
import copy
import types

import torch
import torch.distributed as dist

from dancegrpo.algo.grpo import UpdateBatch
from dancegrpo.models.flux import FluxFamily
from dancegrpo.utils.fsdp_util import wrap_fsdp
from jagg_patch import jagg_group_backward, make_policy_update

from fsdp_jagg_check import M, N_TRAIN, SIGMAS, TIMESTEPS, rank_data, tiny_flux
from dancegrpo.algo.sde import flux_step
from dancegrpo.algo.grpo import ppo_clip_loss

W = 3   # N_TRAIN 6 -> two positions of 3


def update_batch(model, family, data, rows=None):
    rows = torch.arange(M) if rows is None else rows
    cond = {k: v[rows] for k, v in data["cond"].items()}

    def predict(k):
        return family.predict(model, data["latents"][rows, k], TIMESTEPS[k], cond)

    def step_loss(k, v):
        logp = flux_step(v, data["latents"][rows, k], 0.3, SIGMAS, k, prev_sample=data["latents"][rows, k + 1])[2]
        old = logp.detach() + data["ratio_offsets"][rows, k]
        return ppo_clip_loss(logp, old, data["adv"][rows], 10.0, 5.0).sum()

    return UpdateBatch(predict=predict, step_loss=step_loss, steps=data["steps"][rows], timesteps=TIMESTEPS,
                       subset=lambda r: update_batch(model, family, data, rows[r]), step=1,
                       parameters=lambda: [p for p in model.parameters() if p.requires_grad],
                       counted_apart=contextlib.nullcontext,
                       predict_batched=lambda ks: [predict(k) for k in ks])


def reference_metrics(raw, family, world):
    """Slot 0 (each rank's first sample): the full gradient of each group, exact / JAGG / endpoints,
    as the mean over ranks of single-process gradients; then cos and relative error per position."""
    found = {}
    for position in range(N_TRAIN // W):
        grads = {}
        for mode in ("exact", "jagg", "endpoints"):
            model = copy.deepcopy(raw)
            for r in range(world):
                data = rank_data(r)
                one = update_batch(model, family, data, torch.tensor([0]))
                cols = one.steps[:, position * W:(position + 1) * W]
                jagg_group_backward(lambda j: one.predict(cols[:, j]), lambda j, v: one.step_loss(cols[:, j], v),
                                    TIMESTEPS[cols].T, mode, "timestep", "split")
            grads[mode] = torch.cat([p.grad.reshape(-1) / world for p in model.parameters()]).double()
        for mode in ("jagg", "endpoints"):
            e, a = grads["exact"], grads[mode]
            found[f"{mode}_cos/g{position}"] = float(e @ a / (e.norm() * a.norm()))
            found[f"{mode}_relerr/g{position}"] = float((a - e).norm() / e.norm())
    return found


def check(cache_dir, workdir, flags):
    rank, world = dist.get_rank(), dist.get_world_size()
    family = FluxFamily(types.SimpleNamespace(h=64, w=64, guidance=3.5))
    raw = tiny_flux()
    reference = reference_metrics(raw, family, world)
    model = wrap_fsdp(copy.deepcopy(raw), family.block_classes(raw), torch.device("cpu"))
    data = rank_data(rank)
    shards = {}
    for monitor_every in (0, 1):
        for p in model.parameters():
            p.grad = None
        stats = make_policy_update(window=W, jagg_frac=1.0, backward="split", monitor_every=monitor_every, monitor_samples=1)(
            update_batch(model, family, data))
        shards[monitor_every] = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    measured = {k: v for k, v in stats.metrics.items() if "/g" in k and "_cos_" not in k}   # the means (the spread: jagg_cos_sd / _n)
    same = all((a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
               for a, b in zip(shards[0], shards[1]))
    result = dict(same_update=same and any(a is not None for a in shards[0]),
                  measured=measured, reference=reference)
    ranks = [None] * world
    dist.all_gather_object(ranks, result)
    return {"world_size": world, "ranks": ranks}
