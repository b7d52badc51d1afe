"""Check "grad" of run_checks.py (two ranks): the FSDP gradient of the policy update over two ranks'
halves of a batch must equal the single-process gradient over the whole batch. Flags: the trainer's,
and --apply_jagg with --jagg_* flags (then through the JAGG patch, as the launcher applies it).
"""
import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

try:
    from torch.distributed.fsdp import FSDPModule
except ImportError:   # torch 2.5 keeps FSDP2 in torch.distributed._composable.fsdp
    from torch.distributed._composable.fsdp import FSDPModule

from dancegrpo import train_grpo_flux, trainer
from dancegrpo.args import parse_args
from dancegrpo.algo.ratio_stats import RatioMeter
from dancegrpo.build import describe
from dancegrpo.utils.fsdp_util import full_gradients
from dancegrpo.utils.data import PromptEmbeddingDataset, collate_prompts
from dancegrpo.algo.rollout import predict_velocity
from dancegrpo.algo.objective import transition_log_prob
from jagg_patch import apply_jagg
from jagg_patch import JaggConfig
from jagg_patch.cli import add_jagg_args


def same_data_on_every_rank(ctx, ref_model, num_prompts):
    """A batch built from seeds only, so both ranks hold identical copies."""
    args = ctx.args
    ds = PromptEmbeddingDataset(args.data_json_path, ctx.family.embedding_fields)
    cond, _ = trainer.expand_groups(args, collate_prompts([ds[i] for i in range(num_prompts)]))
    g = torch.Generator().manual_seed(0)
    n, S = next(iter(cond.values())).shape[0], args.sampling_steps
    latents = torch.randn(n, S + 1, 16, 64, generator=g)
    ref_ctx = dataclasses.replace(ctx, transformer=ref_model)
    with torch.no_grad():
        log_probs = torch.stack([transition_log_prob(
            ref_ctx, predict_velocity(ref_ctx, latents[:, k], ctx.timesteps[k].expand(n), cond),
            latents[:, k], latents[:, k + 1], k) for k in range(S)], dim=1)
    log_probs += 0.05 * torch.randn(n, S, generator=g)
    adv = 2 * torch.randn(n, generator=g)
    # resolved like train_one_step does: the window grouping's patch applies here too
    selection = train_grpo_flux.select_train_steps(n, S - 1, args.timestep_fraction, torch.Generator().manual_seed(1))
    return cond, trainer.Rollout(latents, log_probs, [], torch.zeros(n)), adv, selection.steps, selection.num_train


def check_args(cache_dir, workdir, flags):
    """The trainer's flags on the tiny preset, with --apply_jagg (+ --jagg_*) patching the trainer
    (run_checks reverts it after the check)."""
    parser = add_jagg_args(train_grpo_flux.build_parser())
    parser.add_argument("--apply_jagg", action="store_true")
    args = parse_args(parser, ["--preset", "tiny", "--cache_dir", cache_dir, "--output_dir", workdir, *flags])
    if args.apply_jagg:
        apply_jagg(JaggConfig.from_args(args), trainer_module=train_grpo_flux)
    return args


def check(cache_dir, workdir, flags):
    args = check_args(cache_dir, workdir, flags)
    ctx = trainer.setup(args, train_grpo_flux.FAMILY(args))
    assert isinstance(ctx.transformer, (FSDP, FSDPModule)), "expected FSDP1 or FSDP2 under torchrun"
    rank, world = dist.get_rank(), dist.get_world_size()
    ref_model, _ = ctx.family.load(args, ctx.device)   # same weights, unwrapped
    if args.use_lora:
        from dancegrpo.adapters.lora import add_lora
        add_lora(ref_model, args, ctx.seed)             # the same adapter: drawn from the run seed
    cond, rollout, adv, steps, num_train = same_data_on_every_rank(ctx, ref_model, num_prompts=2)
    normaliser = args.gradient_accumulation_steps * num_train
    update = train_grpo_flux.policy_update  # resolved like train_one_step does: a patch applies here too

    n = adv.numel()
    mine = torch.arange(rank * n // world, (rank + 1) * n // world)
    ctx.transformer.train()
    stats = trainer.accumulate_policy_gradient(ctx, rollout, cond, adv, mine, steps, normaliser, update)
    fsdp_grads = {k: g * world for k, g in full_gradients(ctx.transformer).items()}  # FSDP averages over ranks
    ratio_stats = ctx.ratio_meter.summary(ctx.device)   # over both ranks' halves

    ref_ctx = dataclasses.replace(ctx, transformer=ref_model, ratio_meter=RatioMeter(keep=True))
    ref_model.train()

    def single_process_gradient():
        ref_model.zero_grad(set_to_none=True)
        trainer.accumulate_policy_gradient(ref_ctx, rollout, cond, adv, torch.arange(n), steps, normaliser, update)
        return {k: p.grad.clone() for k, p in ref_model.named_parameters() if p.requires_grad}
    ref = single_process_gradient()
    assert set(ref) == set(fsdp_grads), sorted(set(ref) ^ set(fsdp_grads))[:4]
    result = {"rel_err": rel_err(fsdp_grads, ref), "ref_norm": norm(ref), "world_size": world,
              "jagg_groups": stats.jagg_groups, "num_trained_tensors": len(ref), "backward_calls": stats.backward_calls,
              "banner": describe(ctx), "ratio_stats": ratio_stats,
              "ratio_reference": by_hand(ref_ctx.ratio_meter.kept, args.clip_range), **ctx.counter.as_dict()}
    if args.mixed_precision == "bf16":   # how far bf16 is from the float32 gradient of the same batch
        args.mixed_precision = "no"
        result["rel_err_vs_float32"] = rel_err(fsdp_grads, single_process_gradient())
    ctx.counter.remove()
    return result


def norm(grads):
    return sum((g.double() ** 2).sum() for g in grads.values()).sqrt().item()


def rel_err(got, ref):
    return norm({k: got[k] - ref[k] for k in ref}) / norm(ref)


def by_hand(kept, clip_range):
    """The PPO statistics of every (sample, transition) the single process scored, written out."""
    ratios = torch.cat([r for _, _, r in kept]).double()
    log_ratios = torch.log(ratios)
    return {"ratio_mean": ratios.mean().item(), "ratio_min": ratios.min().item(), "ratio_max": ratios.max().item(),
            "clip_frac": ((ratios - 1).abs() > clip_range).double().mean().item(),
            "approx_kl": (0.5 * log_ratios ** 2).mean().item(), "count": ratios.numel()}
