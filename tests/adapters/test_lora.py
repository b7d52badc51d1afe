"""LoRA (--use_lora): the update's gradient on the adapter against a float64 reference that writes
the adapter out by hand (W + alpha / r * B A, no peft), vanilla and JAGG; only the adapter trains;
resume is bit-exact; the saved adapter loads into a diffusers pipeline with its alpha."""

import shutil

import pytest
import torch
from torch.func import functional_call

from dancegrpo import train_grpo_flux, train_grpo_qwenimage, trainer
from dancegrpo.algo.grpo import choose_train_steps
from dancegrpo.models.flux import FluxFamily

from helpers import FAST, float64_setup, reference_step_loss, reference_step_velocity, relative_error

LORA = ["--use_lora", "--lora_rank", 4, "--lora_alpha", 12]   # scale alpha / r = 3


def hand_lora_model(args, ctx):
    """A plain float64 copy of the base model and, per adapted Linear, leaf tensors (A, B) with the
    adapter's current values: the model called with W + scale * B @ A written out here."""
    base, _ = FluxFamily(args).load(args, torch.device("cpu"))
    base = base.double().requires_grad_(False)
    factors = {}
    for name, p in ctx.transformer.named_parameters():
        if ".lora_A.default.weight" in name:
            module = name[:-len(".lora_A.default.weight")]
            b = dict(ctx.transformer.named_parameters())[f"{module}.lora_B.default.weight"]
            factors[module] = (p.detach().clone().requires_grad_(True), b.detach().clone().requires_grad_(True))
    scale = args.lora_alpha / args.lora_rank
    weights = dict(base.named_parameters())

    class Adapted:
        def __call__(self, **kwargs):
            params = {f"{m}.weight": weights[f"{m}.weight"] + scale * (b @ a) for m, (a, b) in factors.items()}
            return functional_call(base, params, args=(), kwargs=kwargs)
    return Adapted(), factors


def setup_with_random_b(make_args, *extra):
    args, ctx, cond, rollout, adv = float64_setup(make_args, 2, *LORA, *extra)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # B = 0 at init would leave A without gradient: give both a value
        for name, p in ctx.transformer.named_parameters():
            if ".lora_B." in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return args, ctx, cond, rollout, adv


def adapter_grads(ctx, factors):
    named = dict(ctx.transformer.named_parameters())
    return [g for m in factors for g in (named[f"{m}.lora_A.default.weight"].grad,
                                         named[f"{m}.lora_B.default.weight"].grad)]



def test_only_adapter_parameters_are_trainable(make_args):
    args, ctx, *_ = setup_with_random_b(make_args)
    trainable = [n for n, p in ctx.transformer.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    in_optimizer = {id(p) for group in ctx.optimizer.param_groups for p in group["params"]}
    assert in_optimizer == {id(p) for p in ctx.transformer.parameters() if p.requires_grad}
    targets = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainable}
    assert targets == {"to_q", "to_k", "to_v", "0"}   # to_out.0


def test_vanilla_lora_gradient_equals_float64_reference(make_args):
    args, ctx, cond, rollout, adv = setup_with_random_b(make_args)
    n = adv.numel()
    steps = choose_train_steps(n, args.sampling_steps - 1, 4, torch.Generator().manual_seed(1))
    normaliser = args.gradient_accumulation_steps * 4
    model, factors = hand_lora_model(args, ctx)
    loss = sum(reference_step_loss(reference_step_velocity(model, rollout, cond, b, k, ctx.sigmas, args), rollout, b,
                                   k, adv, ctx.sigmas, args)
               for b in range(n) for k in steps[b].tolist()) / normaliser
    ref = torch.autograd.grad(loss, [t for ab in factors.values() for t in ab])
    trainer.accumulate_policy_gradient(ctx, rollout, cond, adv, torch.arange(n), steps, normaliser,
                                       train_grpo_flux.policy_update)
    assert relative_error(adapter_grads(ctx, factors), ref) < 1e-10


def test_jagg_lora_gradient_equals_float64_reference(make_args):
    """One JAGG group of the 4 trained transitions per sample: the gradient is
    sum_j [(1 - alpha_j) J_first + alpha_j J_last]^T s_j, s_j the step loss's gradient at v_j,
    alpha_j = (t_first - t_j) / (t_first - t_last) in the model timesteps (float32 values, as the
    trainer holds them: float64 decimals would move alpha by ~1e-7)."""
    import numpy as np
    from jagg_patch import apply_jagg, revert_jagg
    from helpers import reference_t
    args, ctx, cond, rollout, adv = setup_with_random_b(make_args)
    n = adv.numel()
    steps = choose_train_steps(n, args.sampling_steps - 1, 4, torch.Generator().manual_seed(1))
    normaliser = args.gradient_accumulation_steps * 4
    model, factors = hand_lora_model(args, ctx)
    surrogate = 0.0
    for b in range(n):
        ks = sorted(steps[b].tolist())
        t = [float(np.float32(reference_t(float(ctx.sigmas[k])))) for k in ks]
        alpha = [(t[0] - tj) / (t[0] - t[-1]) for tj in t]
        first = reference_step_velocity(model, rollout, cond, b, ks[0], ctx.sigmas, args)
        last = reference_step_velocity(model, rollout, cond, b, ks[-1], ctx.sigmas, args)
        signal_first, signal_last = 0.0, 0.0
        for j, k in enumerate(ks):
            with torch.no_grad():
                v = reference_step_velocity(model, rollout, cond, b, k, ctx.sigmas, args)
            v.requires_grad_(True)
            s_j, = torch.autograd.grad(reference_step_loss(v, rollout, b, k, adv, ctx.sigmas, args) / normaliser, v)
            signal_first = signal_first + (1 - alpha[j]) * s_j
            signal_last = signal_last + alpha[j] * s_j
        surrogate = surrogate + (first * signal_first).sum() + (last * signal_last).sum()
    ref = torch.autograd.grad(surrogate, [t for ab in factors.values() for t in ab])
    apply_jagg(trainer_module=train_grpo_flux, window=4, jagg_frac=1.0)
    try:
        stats = trainer.accumulate_policy_gradient(ctx, rollout, cond, adv, torch.arange(n), steps, normaliser,
                                                   train_grpo_flux.policy_update)
    finally:
        revert_jagg(train_grpo_flux)
    assert stats.jagg_groups == n
    assert relative_error(adapter_grads(ctx, factors), ref) < 1e-10


def _adapter_and_base(model):
    adapter = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    return adapter, base


@pytest.mark.parametrize("module", [train_grpo_flux, train_grpo_qwenimage], ids=["flux", "qwenimage"])
@pytest.mark.slow
def test_a_step_changes_the_adapter_only_and_resume_is_bit_exact(make_args, tmp_path, module):
    flags = [*FAST, *LORA, "--learning_rate", "1e-2", "--use_ema", "--checkpointing_steps", 1]
    mod = module.__name__

    def run(out, steps, *extra):
        args = make_args(*flags, "--max_train_steps", steps, "--output_dir", out, *extra, module=mod)
        family = module.FAMILY(args)
        ctx = trainer.setup(args, family)
        before = _adapter_and_base(ctx.transformer)
        module.main(args)
        return before

    before, base = run(tmp_path / "a", 1, "--lora_save_merged")
    from safetensors.torch import load_file
    from dancegrpo.adapters.lora import LoraWeights
    folder = tmp_path / "a" / "checkpoint-1-0"
    state = LoraWeights.read_state(str(folder))
    assert set(state) == set(before) and any(not torch.equal(state[k], before[k]) for k in state)
    lora_b = [k for k in state if ".lora_B." in k]
    assert all(torch.equal(before[k], torch.zeros_like(before[k])) for k in lora_b)   # B = 0: step 0 is the base
    # merged/ = the base the run started from + scale * B A of the trained adapter: the base did not move.
    merged, scale = load_file(str(folder / "merged" / "diffusion_pytorch_model.safetensors")), 12 / 4
    assert set(merged) == {k.replace(".base_layer.", ".") for k in base}
    for key, value in base.items():
        plain = key.replace(".base_layer.", ".")
        if ".base_layer.weight" in key:
            layer = key[:-len(".base_layer.weight")]
            delta = scale * state[f"{layer}.lora_B.default.weight"] @ state[f"{layer}.lora_A.default.weight"]
            assert delta.abs().max() > 0
            torch.testing.assert_close(merged[plain], value + delta, rtol=0, atol=1e-6)
        else:
            assert torch.equal(merged[plain], value), key
    # Resume: 3 unbroken steps vs 2 + 1 after a resume.
    run(tmp_path / "full", 3)
    run(tmp_path / "part", 2)
    run(tmp_path / "part", 3, "--resume_from_lora_checkpoint", "latest")
    for name in ("", "ema"):
        a = LoraWeights.read_state(str(tmp_path / "full" / "checkpoint-3-0" / name))
        b = LoraWeights.read_state(str(tmp_path / "part" / "checkpoint-3-0" / name))
        assert all(torch.equal(a[k], b[k]) for k in a), name


def test_resume_refuses_a_full_checkpoint_and_a_different_rank(make_args, tmp_path):
    from dancegrpo.errors import ConfigError
    train_grpo_flux.main(make_args(*FAST, "--max_train_steps", 1, "--output_dir", tmp_path / "full"))
    with pytest.raises(ConfigError, match="holds no pytorch_lora_weights.safetensors"):
        trainer.setup(make_args(*FAST, *LORA, "--resume_from_checkpoint", tmp_path / "full" / "checkpoint-1-0",
                                "--output_dir", tmp_path / "x"), FluxFamily(make_args()))
    train_grpo_flux.main(make_args(*FAST, *LORA, "--max_train_steps", 1, "--output_dir", tmp_path / "lora"))
    args = make_args(*FAST, "--use_lora", "--lora_rank", 8, "--lora_alpha", 12, "--allow_config_change",
                     "--resume_from_checkpoint", tmp_path / "lora" / "checkpoint-1-0", "--output_dir", tmp_path / "y")
    with pytest.raises(ConfigError, match="lora_rank differs"):
        trainer.setup(args, FluxFamily(args))


def _pipeline(family, model_root, text_root, transformer):
    import diffusers
    from transformers import AutoTokenizer
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler()
    if family == "flux":
        from transformers import CLIPTextModel, T5EncoderModel
        return diffusers.FluxPipeline(
            scheduler=scheduler, vae=diffusers.AutoencoderKL.from_pretrained(model_root, subfolder="vae"),
            transformer=transformer,
            text_encoder=CLIPTextModel.from_pretrained(text_root, subfolder="text_encoder"),
            tokenizer=AutoTokenizer.from_pretrained(text_root, subfolder="tokenizer"),
            text_encoder_2=T5EncoderModel.from_pretrained(text_root, subfolder="text_encoder_2"),
            tokenizer_2=AutoTokenizer.from_pretrained(text_root, subfolder="tokenizer_2"))
    from transformers import Qwen2_5_VLForConditionalGeneration
    return diffusers.QwenImagePipeline(
        scheduler=scheduler, vae=diffusers.AutoencoderKLQwenImage.from_pretrained(model_root, subfolder="vae"),
        transformer=transformer,
        text_encoder=Qwen2_5_VLForConditionalGeneration.from_pretrained(text_root, subfolder="text_encoder"),
        tokenizer=AutoTokenizer.from_pretrained(text_root, subfolder="tokenizer"))


def _image(pipe, family):
    kwargs = dict(max_sequence_length=16) if family == "flux" else dict(true_cfg_scale=1.0, max_sequence_length=16)
    with torch.no_grad():
        return pipe("a red fox in the snow", height=64, width=64, num_inference_steps=2, output_type="pt",
                    generator=torch.Generator().manual_seed(0), **kwargs).images


@pytest.mark.parametrize("family", ["flux", "qwenimage"])
def test_saved_adapter_loads_into_the_diffusers_pipeline_with_its_alpha(make_args, tmp_path, family):
    """The checkpoint's adapter, read by <Pipeline>.load_lora_weights(dir), changes the pipeline's
    image, and to the image of the merged/ transformer (W + alpha / r * B A): the alpha survived
    (without the stored LoraConfig diffusers would take alpha = r, a third of this run's scale)."""
    import diffusers
    from tiny_text_encoders import build_flux_text_folder, build_qwen_text_folder
    module = {"flux": train_grpo_flux, "qwenimage": train_grpo_qwenimage}[family]
    args = make_args(*FAST, *LORA, "--learning_rate", "3e-2", "--max_train_steps", 1, "--lora_save_merged",
                     "--output_dir", tmp_path / "run", module=module.__name__)
    module.main(args)
    folder = tmp_path / "run" / "checkpoint-1-0"
    text = (build_flux_text_folder if family == "flux" else build_qwen_text_folder)(str(tmp_path / "text"))
    cls = getattr(diffusers, module.FAMILY.transformer_class_name)
    pipe = _pipeline(family, args.pretrained_model_name_or_path, text,
                     cls.from_pretrained(args.pretrained_model_name_or_path, subfolder="transformer"))
    base = _image(pipe, family)
    pipe.load_lora_weights(str(folder))
    adapted = _image(pipe, family)
    merged = _image(_pipeline(family, args.pretrained_model_name_or_path, text,
                              cls.from_pretrained(str(folder / "merged"))), family)
    assert (adapted - base).abs().max() > 1e-3
    torch.testing.assert_close(adapted, merged, atol=2e-4, rtol=0)


def test_evaluate_reads_a_lora_checkpoint_like_its_merged_weights(make_args, tmp_path, cache_dir, capsys):
    from dancegrpo import evaluate
    args = make_args(*FAST, *LORA, "--learning_rate", "3e-2", "--max_train_steps", 1, "--lora_save_merged",
                     "--output_dir", tmp_path / "run")
    train_grpo_flux.main(args)
    folder = tmp_path / "run" / "checkpoint-1-0"
    rows = evaluate.main(["--preset", "tiny", "--cache_dir", cache_dir, "--metrics", "jpeg", "--max_prompts", "2",
                          "--num_images_per_prompt", "2", "--output_dir", str(tmp_path / "eval"),
                          "--checkpoint", f"base={args.pretrained_model_name_or_path}",
                          "--checkpoint", f"lora={folder}", "--checkpoint", f"merged={folder / 'merged'}"])
    score = {r["label"]: r["metrics"]["jpeg"]["mean"] for r in rows}
    assert score["lora"] == pytest.approx(score["merged"], abs=1e-3) and score["lora"] != score["base"]
    with pytest.raises(SystemExit):   # an adapter without its base model is refused, with a message
        evaluate.main(["--metrics", "jpeg", "--vae_model_path", args.pretrained_model_name_or_path,
                       "--data_json_path", args.data_json_path, "--output_dir", str(tmp_path / "e2"),
                       "--checkpoint", f"lora={folder}"])
    assert "is a LoRA adapter: pass --pretrained_model_name_or_path" in capsys.readouterr().err


def _strip_origin(folder):
    """The adapter as another tool would write it: diffusers' keys and LoraConfig, no origin record."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    from dancegrpo.adapters.origin import ORIGIN_KEY
    path = str(folder / "pytorch_lora_weights.safetensors")
    with safe_open(path, "pt") as f:
        metadata = {k: v for k, v in f.metadata().items() if k != ORIGIN_KEY}
    save_file(load_file(path), path, metadata=metadata)


def test_an_adapter_is_refused_on_the_other_family_wherever_it_loads(make_args, tmp_path, cache_dir, capsys):
    """A Flux adapter given to Qwen-Image (evaluate, and the trainer's resume) is refused with both
    families named, before it loads; without its origin record, by its keys that fit no layer."""
    from dancegrpo import evaluate
    from dancegrpo.errors import ConfigError
    from dancegrpo.models.qwenimage import QwenImageFamily
    train_grpo_flux.main(make_args(*FAST, *LORA, "--max_train_steps", 1, "--output_dir", tmp_path / "run"))
    folder = tmp_path / "run" / "checkpoint-1-0"
    qwen = ["--family", "qwenimage", "--preset", "tiny", "--cache_dir", cache_dir, "--metrics", "jpeg",
            "--max_prompts", "1", "--num_images_per_prompt", "1", "--checkpoint", f"lora={folder}"]
    with pytest.raises(SystemExit):
        evaluate.main([*qwen, "--output_dir", str(tmp_path / "eval")])
    err = capsys.readouterr().err
    assert "FluxTransformer2DModel (flux)" in err and "QwenImageTransformer2DModel (qwenimage)" in err
    assert not (tmp_path / "eval").exists()   # refused before anything ran
    args = make_args(*FAST, *LORA, "--allow_config_change", "--resume_from_lora_checkpoint", folder,
                     "--output_dir", tmp_path / "q", module=train_grpo_qwenimage.__name__)
    with pytest.raises(ConfigError, match=r"trained on a FluxTransformer2DModel \(flux\) but this model is a "
                                          r"QwenImageTransformer2DModel \(qwenimage\)"):
        trainer.setup(args, QwenImageFamily(args))
    bare = tmp_path / "bare"   # the adapter file alone, without the record: as another tool writes it
    bare.mkdir()
    shutil.copy(folder / "pytorch_lora_weights.safetensors", bare)
    _strip_origin(bare)
    with pytest.raises(SystemExit):
        evaluate.main([*qwen[:-1], f"lora={bare}", "--output_dir", str(tmp_path / "eval2")])
    assert "fit no layer of this QwenImageTransformer2DModel" in capsys.readouterr().err
    args.resume_from_checkpoint = str(bare)
    with pytest.raises(ConfigError, match="fit no layer of this QwenImageTransformer2DModel"):
        trainer.setup(args, QwenImageFamily(args))


def test_an_adapter_is_refused_on_a_base_of_another_architecture(make_args, tmp_path):
    """Same family, another base (a different layer count): the record names the differing entry."""
    import json
    from dancegrpo.errors import ConfigError
    train_grpo_flux.main(make_args(*FAST, *LORA, "--max_train_steps", 1, "--output_dir", tmp_path / "run"))
    base = tmp_path / "base"
    shutil.copytree(make_args().pretrained_model_name_or_path, base, ignore=shutil.ignore_patterns("data"))
    config = json.loads((base / "transformer" / "config.json").read_text())
    config["num_single_layers"] += 1
    (base / "transformer" / "config.json").write_text(json.dumps(config))
    args = make_args(*FAST, *LORA, "--allow_config_change", "--pretrained_model_name_or_path", base,
                     "--resume_from_checkpoint", tmp_path / "run" / "checkpoint-1-0", "--output_dir", tmp_path / "x")
    with pytest.raises(ConfigError, match=rf"num_single_layers {config['num_single_layers'] - 1} -> "
                                          rf"{config['num_single_layers']}\): pass its base model"):
        trainer.setup(args, FluxFamily(args))
