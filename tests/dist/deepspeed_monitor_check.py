"""Check "deepspeed_monitor" of run_checks.py (two ranks): jagg_patch's monitor on tiny Flux under a
DeepSpeed ZeRO engine (gloo, CPU; flags: the ZeRO stage). Its cosines and relative errors must be
those of the FULL gradient (the ranks' samples averaged), computed in one process on an unwrapped
copy (fsdp_monitor_check.reference_metrics); and the update with the monitor must step to the same
weights, bit for bit, as the update without it.
"""
import copy
import types

import torch
import torch.distributed as dist

from dancegrpo.engines.deepspeed import DeepSpeedEngine
from dancegrpo.models.flux import FluxFamily
from jagg_patch import make_policy_update

from fsdp_jagg_check import rank_data, tiny_flux
from fsdp_monitor_check import W, reference_metrics, update_batch


def engine_of(raw, stage):
    args = types.SimpleNamespace(deepspeed_settings={"zero_optimization": {"stage": stage}}, max_grad_norm=1.0,
                                 mixed_precision=None)
    optimizer = torch.optim.AdamW([p for p in raw.parameters() if p.requires_grad], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return DeepSpeedEngine(raw, optimizer, scheduler, args, torch.device("cpu"))


def stepped_weights(raw, family, data, stage, monitor_every):
    """A fresh engine around a copy of raw: one update of this rank's data (monitored or not), one
    optimizer step; returns (the monitor's metrics, the full weights after the step)."""
    engine = engine_of(copy.deepcopy(raw), stage)
    batch = update_batch(engine.model, family, data)
    batch.backward, batch.gradient_probe = engine.backward, engine.gradient_probe
    stats = make_policy_update(window=W, jagg_frac=1.0, backward="split", monitor_every=monitor_every, monitor_samples=1)(batch)
    engine.optimizer_step(lambda norm: None)
    return stats.metrics, engine.full_state()


def check(cache_dir, workdir, flags):
    stage = int(flags[0])
    rank, world = dist.get_rank(), dist.get_world_size()
    family = FluxFamily(types.SimpleNamespace(h=64, w=64, guidance=3.5))
    raw = tiny_flux()
    reference = reference_metrics(raw, family, world)
    data = rank_data(rank)
    _, plain = stepped_weights(raw, family, data, stage, 0)
    metrics, monitored = stepped_weights(raw, family, data, stage, 1)
    moved = max((plain[k] - v).abs().max().item() for k, v in raw.state_dict().items())
    result = dict(same_step=all(torch.equal(plain[k], monitored[k]) for k in plain), moved=moved,
                  measured={k: v for k, v in metrics.items() if "/g" in k and "_cos_" not in k},   # means, not spreads
                  reference=reference)
    ranks = [None] * world
    dist.all_gather_object(ranks, result)
    return {"world_size": world, "stage": stage, "ranks": ranks}
