"""Check "deferred" of run_checks.py (two ranks): jagg_patch.deferred under DDP and FSDP.

--deferred_case ddp_loop: DanceGRPO's Flux loop (tests/deferred_loops.py) on a DDP model with the
  proxy outside DDP, each rank its own data and trained count (so their replays differ in number),
  then a run where one rank's signals are all zero (nothing to replay: a zero row): the gradient at
  the optimizer step equals the mean of the ranks' own float64 JAGG references, and every rank runs
  exactly one synced DDP forward / backward per flush.
otherwise (the trainer's flags, --engine fsdp or fsdp2): this project's trainer's own vanilla update
  through the proxy, its transformer a float64 copy sharded by FSDP1 or FSDP2, the ranks holding
  n/2 + 1 and n/2 - 1 samples (one rank's replays padded); its full gradient equals the single-process
  restated JAGG gradient over all n, float64.
"""
import dataclasses
import sys

import torch
import torch.distributed as dist


def check(cache_dir, workdir, flags):
    flags = list(flags)
    if "--deferred_case" in flags:
        i = flags.index("--deferred_case")
        case = flags[i + 1]
        del flags[i:i + 2]
        assert case == "ddp_loop", case
        return ddp_loop()
    return fsdp_trainer(cache_dir, workdir, flags)


def _mean_over_ranks(t):
    t = t.clone()
    dist.all_reduce(t)
    return t / dist.get_world_size()


def ddp_loop():
    from deferred_loops import LOOPS, Log, Setting, Velocity, capture_grads, reference_gradients
    from helpers import relative_error
    from jagg_patch import JaggConfig
    from jagg_patch import deferred
    rank = dist.get_rank()
    config = JaggConfig(window=4, jagg_frac=1.0)
    results = {}
    for name, setting in (("uneven", Setting(trained=4 if rank == 0 else 6, seed=rank)),
                          ("one_rank_idle", Setting(seed=rank, adv_clip_max=5.0 if rank == 0 else 0.0))):
        model = Velocity()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        synced = []
        ddp.register_forward_pre_hook(lambda *a: synced.append(torch.is_grad_enabled()))
        proxy = deferred.wrap(ddp, config)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        proxy.attach(optimizer)
        log = Log()
        capture_grads(optimizer, list(model.parameters()), log)
        LOOPS["flux"](proxy, optimizer, setting, log, torch.Generator().manual_seed(rank))
        proxy.close()
        ref = [_mean_over_ranks(g) for g in reference_gradients(Velocity(), "flux", setting, config, rank)]
        stats = proxy.stats
        results[name] = {"rel_err": max(relative_error(a, b) for a, b in zip(log.grads, ref)),
                         "steps": len(log.grads), "flushes": len(stats),
                         "ddp_forwards": synced.count(True), "padding_rows": sum(s.padding_rows for s in stats),
                         "chunks": sum(s.backward_calls for s in stats)}
    return _gathered(results)


def _gathered(result):
    """Every rank's result, rank 0's list."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, result)
    return {"ranks": out, "world_size": dist.get_world_size()}


def float64_sharded(model, blocks, engine):
    """A float64 copy of `model` sharded over the ranks as the engine shards it (its blocks units, then
    the root), without a mixed-precision policy: the engines' own compute in float32 or bf16."""
    import copy
    from dancegrpo.utils.fsdp_util import broadcast_module_states
    model = copy.deepcopy(model).double()
    broadcast_module_states(model)
    if engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for unit in [m for m in model.modules() if isinstance(m, blocks)]:
            fully_shard(unit)
        fully_shard(model)
        return model
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    return FSDP(model, auto_wrap_policy=ModuleWrapPolicy(set(blocks)), device_id=torch.device("cpu"),
                use_orig_params=True)


def fsdp_trainer(cache_dir, workdir, flags):
    """This project's trainer's update, its transformer a float64 copy under FSDP1 / FSDP2, the ranks
    holding n/2 + 1 and n/2 - 1 samples (and over half of rank 1's sending no signal: fewer chunks
    there, padded); the full gradient against the single-process restated update over all n."""
    from dancegrpo import train_grpo_flux, trainer
    from dancegrpo.algo import grpo
    from dancegrpo.algo.rollout import predict_velocity
    from dancegrpo.utils.fsdp_util import full_gradients
    from fsdp_grad_check import check_args, rel_err, same_data_on_every_rank
    from jagg_patch import JaggConfig, make_policy_update
    from jagg_patch import deferred
    args = check_args(cache_dir, workdir, flags + ["--update_batch_size", "64"])   # one micro-batch a rank
    ctx = trainer.setup(args, train_grpo_flux.FAMILY(args))
    rank, world = dist.get_rank(), dist.get_world_size()
    ref_model, _ = ctx.family.load(args, ctx.device)
    cond, rollout, adv, steps, num_train = same_data_on_every_rank(ctx, ref_model, num_prompts=2)
    ref_model.double()
    cond = {k: v.double() for k, v in cond.items()}
    rollout = trainer.Rollout(rollout.latents.double(), rollout.log_probs.double(), [], rollout.rewards)
    adv = adv.double()
    n = adv.numel()
    split = n // 2 + 1
    adv[split:split + (n - split) // 2 + 1] = 0.0
    normaliser = args.gradient_accumulation_steps * num_train
    mine = torch.arange(0, split) if rank == 0 else torch.arange(split, n)
    sharded = float64_sharded(ref_model, ctx.family.block_classes(ref_model), args.engine)
    config = JaggConfig(window=4, jagg_frac=1.0, reuse=args.jagg_reuse_rollout)
    proxy = deferred.wrap(sharded, config)
    ctx_p = dataclasses.replace(ctx, transformer=proxy)
    with torch.no_grad():   # the rollout's calls, through the proxy: each rank its own samples
        for k in range(args.sampling_steps):
            predict_velocity(ctx_p, rollout.latents[mine, k], ctx.timesteps[k].expand(len(mine)),
                             {key: v[mine] for key, v in cond.items()})
    sharded.train()
    trainer.accumulate_policy_gradient(ctx_p, rollout, cond, adv, mine, steps, normaliser, grpo.policy_update,
                                       on_policy=True)
    proxy.flush()
    fsdp_grads = {k: g * world for k, g in full_gradients(sharded).items()}
    proxy.close()
    ref_ctx = dataclasses.replace(ctx, transformer=ref_model)
    ref_model.train()
    trainer.accumulate_policy_gradient(ref_ctx, rollout, cond, adv, torch.arange(n), steps, normaliser,
                                       make_policy_update(config), on_policy=True)
    ref = {k: p.grad.clone() for k, p in ref_model.named_parameters() if p.requires_grad}
    stats = proxy.stats[-1]
    return _gathered({"rel_err": rel_err(fsdp_grads, ref), "padding_rows": stats.padding_rows,
                      "zero_rows": stats.zero_rows, "chunks": stats.backward_calls, "jagg_groups": stats.jagg_groups,
                      "forwards_reused": stats.forwards_reused, "exact_rows": stats.exact_rows, "samples": len(mine),
                      "engine": type(sharded).__name__, "dtype": str(next(sharded.parameters()).dtype)})


if __name__ == "__main__":
    sys.exit("run through tests/dist/run_checks.py")
