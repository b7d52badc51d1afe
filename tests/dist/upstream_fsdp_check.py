"""Check "upstream" of run_checks.py (two ranks): jagg_patch.upstream on the Flux stand-in with its
transformer under FSDP1 (gloo, CPU), as upstream wraps it. Returns:
- rel_exact: exact mode's gradient against the stand-in's own train_one_step, both under FSDP;
- rel_jagg: JAGG (backward auto, i.e. batched on 2 ranks, with rollout reuse) under FSDP against the
  mean over ranks of the JAGG gradients of the same step on an unwrapped copy of the weights;
- stats: rank 0's hook counts of the FSDP JAGG step;
- hunyuan: the HunyuanVideo stand-in under FSDP1, best of 2 of 4: exact mode == its own step with
  FSDP's own clip biting (the full gradient's norm on every rank), and JAGG (auto: batched) == the mean
  over ranks of float64 single-process JAGG gradients;
- wan: the Wan stand-in under FSDP1 with a clip that bites: exact mode == its own step (each rank
  clips by its own shard's norm, upstream's defect, reproduced), that per-shard clip != the full
  norm's, and the one line saying so printed once in two steps.
Gradients are read at the optimizer step (SGD at lr 0, so every run starts from the same weights)."""
import contextlib
import copy
import io
import os
import types

import torch
import torch.distributed as dist

STANDIN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "upstream_standin")
B = 4   # one prompt x 4 generations per rank, GA 4: one optimizer step


def check(cache_dir, workdir, flags):
    """The stand-ins as known releases (as the harness's standins_known fixture makes them in the tests):
    the restated step runs them."""
    import importlib
    from upstream_harness import standin_releases
    fingerprint_module = importlib.import_module("jagg_patch.upstream.fingerprint")
    saved = fingerprint_module.UPSTREAM_RELEASES
    fingerprint_module.UPSTREAM_RELEASES = saved + standin_releases()
    try:
        if "wan" in flags:
            from helpers import relative_error
            return {"wan": wan_check(cache_dir, workdir, relative_error)}
        return _check(cache_dir, workdir, flags)
    finally:
        fingerprint_module.UPSTREAM_RELEASES = saved


def _check(cache_dir, workdir, flags):
    rank, world = dist.get_rank(), dist.get_world_size()
    from dancegrpo.utils.fsdp_util import full_gradients, wrap_fsdp
    from dancegrpo.models.flux import FluxFamily
    from jagg_patch.upstream import apply, load_trainer, revert

    # load_trainer puts the stand-in checkout on the path, as for a user's checkout
    module = load_trainer(os.path.join(STANDIN, "fastvideo", "train_grpo_flux.py"))
    from fastvideo.utils.standin_setup import ClipGradModule, latent_reward, load_transformer, prompt_batches
    from fastvideo.utils.standin_setup import standin_parser
    args = standin_parser().parse_args(
        ["--cache_dir", cache_dir, "--output_dir", os.path.join(workdir, f"rank{rank}"), "--use_group",
         "--num_generations", str(B),
         "--gradient_accumulation_steps", str(B), "--clip_range", "0.05", "--max_grad_norm", "1e9"])
    plain, data_json = load_transformer("flux", cache_dir, torch.float32)
    batches = prompt_batches("flux", data_json, 1, torch.float64)
    batch = [next(batches) for _ in range(rank + 1)][-1]   # each rank its own prompt
    family = FluxFamily(types.SimpleNamespace(h=64, w=64))
    fsdp = wrap_fsdp(copy.deepcopy(plain.module), family.block_classes(plain.module), torch.device("cpu"))
    os.makedirs(os.path.join(workdir, f"cwd{rank}"), exist_ok=True)
    os.chdir(os.path.join(workdir, f"cwd{rank}"))   # ./reward.txt (run_checks goes back)

    def step(model):
        torch.manual_seed(11 + rank)
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.SGD(trainable, lr=0.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        grads = []
        optimizer.register_step_pre_hook(lambda *_: grads.append(full_gradients(model)))
        module.train_one_step(args, torch.device("cpu"), model, None, latent_reward, None, optimizer, scheduler,
                              iter([batch]), None, args.max_grad_norm, None, None)
        (grad,) = grads
        return grad

    upstream = step(fsdp)
    apply(module, mode="exact", restated=True)
    exact = step(fsdp)
    apply(module, window=4, jagg_frac=1.0, backward="auto", reuse="on_policy")
    jagg = step(fsdp)
    stats = module.train_one_step.last_stats
    # This rank's JAGG gradient without FSDP, in float64: the stand-in's latents are float64, which
    # FSDP's fp32 mixed precision casts for its float32 weights.
    local = step(ClipGradModule(copy.deepcopy(plain.module).double()))
    revert(module)
    reference = {}
    for name, grad in local.items():
        dist.all_reduce(grad)
        reference[name.removeprefix("module.")] = grad.float() / world   # FSDP averages over ranks

    from helpers import relative_error as rel
    return {"world_size": world, "rel_exact": rel(exact, upstream), "rel_jagg": rel(jagg, reference),
            "same_names": set(jagg) == set(reference), "ref_norm": sum(float(g.norm()) for g in reference.values()),
            "stats": stats, "hunyuan": hunyuan_check(workdir, rel)}


def wan_check(cache_dir, workdir, rel):
    """Exact mode on the Wan stand-in under FSDP1, with --max_grad_norm small enough that the clip acts."""
    from dancegrpo.utils.fsdp_util import full_gradients, wrap_fsdp
    from jagg_patch.upstream import apply, load_trainer, revert
    module = load_trainer(os.path.join(STANDIN, "fastvideo", "train_grpo_wan_2_1.py"))
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock
    from fastvideo.utils.standin_setup import latent_reward, load_wan_transformer, standin_parser, wan_prompts
    rank = dist.get_rank()
    args = standin_parser().parse_args(
        ["--cache_dir", cache_dir, "--output_dir", os.path.join(workdir, f"wan{rank}"), "--use_group",
         "--num_generations", str(B), "--gradient_accumulation_steps", str(B), "--clip_range", "0.05",
         "--max_grad_norm", "1e-4"])
    batch = [next(wan_prompts(1)) for _ in range(rank + 1)][-1]
    fsdp = wrap_fsdp(load_wan_transformer(torch.float32), [WanTransformerBlock], torch.device("cpu"))

    def step():
        torch.manual_seed(13 + rank)
        optimizer = torch.optim.SGD(fsdp.parameters(), lr=0.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        grads = []
        optimizer.register_step_pre_hook(lambda *_: grads.append(full_gradients(fsdp)))
        _, grad_norm = module.train_one_step(args, torch.device("cpu"), fsdp, None, latent_reward, None, optimizer,
                                             scheduler, *batch, None, args.max_grad_norm, None)
        return grads[0], grad_norm

    upstream, upstream_norm = step()
    apply(module, mode="exact", restated=True)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exact, exact_norm = step()
        step()
    revert(module)
    norms = torch.tensor([upstream_norm])
    dist.all_reduce(norms)   # the ranks' shard norms differ: each clipped its shard by its own
    return {"rel_exact": rel(exact, upstream), "norm_equal": exact_norm == upstream_norm,
            "note_lines": printed.getvalue().count("each rank clips by the norm of its own shard"),
            "norm_differs_over_ranks": abs(norms.item() / dist.get_world_size() - upstream_norm) > 1e-9}


def hunyuan_check(workdir, rel):
    from dancegrpo.utils.fsdp_util import full_gradients, wrap_fsdp
    from jagg_patch.upstream import apply, load_trainer, revert
    module = load_trainer(os.path.join(STANDIN, "fastvideo", "train_grpo_hunyuan.py"))
    from fastvideo.utils.standin_setup import ClipGradModule, VideoAlign, load_video_transformer, video_parser
    from fastvideo.utils.standin_setup import video_prompts
    rank, world = dist.get_rank(), dist.get_world_size()
    args = video_parser("hunyuan").parse_args(
        ["--output_dir", os.path.join(workdir, f"hunyuan{rank}"), "--use_group", "--use_videoalign",
         "--num_generations", "4", "--bestofn", "2", "--gradient_accumulation_steps", "2", "--sampling_steps", "6",
         "--timestep_fraction", "1"])
    prompts = video_prompts(1)
    batch = [next(prompts) for _ in range(rank + 1)][-1]   # each rank its own prompt
    plain = load_video_transformer("hunyuan", torch.float32).module
    fsdp = wrap_fsdp(copy.deepcopy(plain), [torch.nn.Sequential], torch.device("cpu"))

    def step(model, max_grad_norm):
        torch.manual_seed(17 + rank)
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        grads = []
        optimizer.register_step_pre_hook(lambda *_: grads.append(full_gradients(model)))
        _, grad_norm = module.train_one_step(args, torch.device("cpu"), model, None, VideoAlign(), optimizer,
                                             scheduler, iter([batch]), max_grad_norm, 1)
        (grad,) = grads
        return grad, grad_norm

    upstream, upstream_norm = step(fsdp, 1e-4)   # the clip bites
    apply(module, mode="exact", restated=True)
    exact, exact_norm = step(fsdp, 1e-4)
    apply(module, window=4, jagg_frac=1.0, backward="auto", reuse="on_policy")
    jagg, _ = step(fsdp, 1e9)
    stats = module.train_one_step.last_stats
    local, _ = step(ClipGradModule(copy.deepcopy(plain).double()), 1e9)
    revert(module)
    reference = {}
    for name, grad in local.items():
        dist.all_reduce(grad)
        reference[name.removeprefix("module.")] = grad.float() / world
    clipped = sum(float(g.norm()) ** 2 for g in upstream.values()) ** 0.5
    return {"rel_exact": rel(exact, upstream), "norm_rel": abs(exact_norm - upstream_norm) / upstream_norm,
            "clipped_norm": clipped, "rel_jagg": rel(jagg, reference), "same_names": set(jagg) == set(reference),
            "backwards": stats["transformer_backwards"], "backward_calls": stats["backward_calls"]}
