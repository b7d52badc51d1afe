"""train_flux.sh and train_qwenimage.sh: upstream recipe defaults, vanilla/JAGG switch,
missing-weights message, tiny preset on CPU."""
import importlib
import os
import shlex
import subprocess

import pytest

from dancegrpo.args import parse_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMON = dict(train_batch_size=2, gradient_accumulation_steps=12, learning_rate=1e-5, h=720, w=720, eta=0.3,
              num_generations=12, shift=3.0, timestep_fraction=0.6, clip_range=1e-4, adv_clip_max=5.0, seed=42,
              use_group=True, init_same_noise=True, gradient_checkpointing=True, mixed_precision="bf16",
              weight_decay=1e-4, lr_warmup_steps=0)
# Upstream's recipes (docs/gpu_training.md, the table): Flux 8-GPU, Qwen-Image.
SCRIPTS = {
    "flux": ("train_flux.sh", "dancegrpo.train_grpo_flux", "black-forest-labs/FLUX.1-dev",
             dict(COMMON, sampling_steps=16, checkpointing_steps=40, max_grad_norm=0.01, use_ema=True,
                  ema_decay=0.995, sampler_seed=1223627, train_sp_batch_size=2)),
    "qwenimage": ("train_qwenimage.sh", "dancegrpo.train_grpo_qwenimage", "Qwen/Qwen-Image",
                  dict(COMMON, sampling_steps=20, checkpointing_steps=60, max_grad_norm=1.0,
                       selective_checkpointing=0.5, sampler_seed=12627)),
}


@pytest.fixture(params=sorted(SCRIPTS))
def script(request):
    return SCRIPTS[request.param]


def run_sh(script, env, *extra, stub=None, timeout=300):
    full = {**os.environ, **env}
    if stub:  # a fake `torchrun` that records its arguments, in place of the scripts' launcher
        full["PATH"] = f"{stub}:{full['PATH']}"
        full["TORCHRUN"] = "torchrun"
    return subprocess.run(["bash", os.path.join(ROOT, script[0]), *extra], cwd=ROOT, env=full,
                          capture_output=True, text=True, timeout=timeout)


def make_stub(tmp_path):
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "torchrun").write_text('#!/usr/bin/env bash\nprintf "%q " "$@" > "$TORCHRUN_LOG"\n')
    (stub / "torchrun").chmod(0o755)
    return str(stub)


def fake_weights(tmp_path):
    model = tmp_path / "qwen"
    for sub in ("transformer", "vae"):
        (model / sub).mkdir(parents=True)
        (model / sub / "config.json").write_text("{}")
    data = tmp_path / "emb" / "videos2caption.json"
    data.parent.mkdir()
    data.write_text("[]")
    return str(model), str(data)


def stubbed_run(tmp_path, **env):
    """(env for a script run with fake weights and the recording torchrun stub, the stub's folder)."""
    model, data = fake_weights(tmp_path)
    log = str(tmp_path / "argv")
    base = {"MODEL_PATH": model, "DATA_JSON": data, "OUTPUT_DIR": str(tmp_path / "out"), "TORCHRUN_LOG": log}
    return {**base, **env}, make_stub(tmp_path)


def recorded_argv(env):
    with open(env["TORCHRUN_LOG"]) as f:
        return shlex.split(f.read())


def test_missing_weights_message(script, tmp_path):
    res = run_sh(script, {"MODEL_PATH": str(tmp_path / "nowhere")}, stub=make_stub(tmp_path))
    assert res.returncode != 0
    assert f"huggingface-cli download {script[2]}" in res.stderr and "transformer/" in res.stderr
    assert "PRESET=tiny bash" in res.stderr


def test_recipe_defaults_vanilla_and_jagg(script, tmp_path):
    env, stub = stubbed_run(tmp_path)
    module = script[1]
    assert run_sh(script, env, "--max_train_steps", "7", stub=stub).returncode == 0
    argv = recorded_argv(env)
    assert argv[:4] == ["--standalone", "--nproc_per_node=8", "-m", module]
    args = parse_args(importlib.import_module(module).build_parser(), argv[4:])
    expected = dict(script[3], max_train_steps=7, pretrained_model_name_or_path=env["MODEL_PATH"],
                    data_json_path=env["DATA_JSON"])
    assert {k: getattr(args, k) for k in expected} == expected
    assert args.reward_terms == [("hpsv2", 1.0)]

    env.update(JAGG="1", JAGG_WINDOW="3", NPROC="2")
    assert run_sh(script, env, stub=stub).returncode == 0
    argv = recorded_argv(env)
    assert argv[:10] == ["--standalone", "--nproc_per_node=2", "-m", "jagg_patch", module,
                         "--jagg_window", "3", "--jagg_frac", "0.6", "--jagg_mode"]


def test_flux_16gpu_recipe_on_two_nodes(tmp_path):
    """Upstream's 2x8-GPU recipe: every node runs the same command with its NODE_RANK."""
    env, stub = stubbed_run(tmp_path, RECIPE="16gpu", NODE_RANK="1", MASTER_ADDR="10.1.2.3", MASTER_PORT="29611")
    assert run_sh(SCRIPTS["flux"], env, stub=stub).returncode == 0
    argv = recorded_argv(env)
    assert argv[:7] == ["--nnodes=2", "--node_rank=1", "--master_addr=10.1.2.3", "--master_port=29611",
                        "--nproc_per_node=8", "-m", "dancegrpo.train_grpo_flux"]
    args = parse_args(importlib.import_module("dancegrpo.train_grpo_flux").build_parser(), argv[7:])
    expected = dict(SCRIPTS["flux"][3], train_batch_size=1, gradient_accumulation_steps=4, max_grad_norm=1.0,
                    use_ema=False, sampler_seed=1223627, train_sp_batch_size=1)
    assert {k: getattr(args, k) for k in expected} == expected

    del env["NODE_RANK"]
    res = run_sh(SCRIPTS["flux"], env, stub=stub)
    assert res.returncode == 2 and "NODE_RANK" in res.stderr and "MASTER_ADDR" in res.stderr
    res = run_sh(SCRIPTS["flux"], {**env, "RECIPE": "32gpu"}, stub=stub)
    assert res.returncode == 2 and "RECIPE must be 8gpu or 16gpu" in res.stderr


def test_multi_node_env_vars(script, tmp_path):
    env, stub = stubbed_run(tmp_path, NNODES="3", NODE_RANK="2", MASTER_ADDR="head", NPROC="4")
    assert run_sh(script, env, stub=stub).returncode == 0
    argv = recorded_argv(env)
    assert argv[:5] == ["--nnodes=3", "--node_rank=2", "--master_addr=head", "--master_port=29500",
                        "--nproc_per_node=4"]


@pytest.mark.slow
def test_tiny_preset_runs_on_cpu(script, tmp_path, preset_cache):
    res = run_sh(script, {"PRESET": "tiny", "OUTPUT_DIR": str(tmp_path / "out"), "CACHE_DIR": preset_cache},
                 "--max_train_steps", "1", "--train_batch_size", "2", "--num_generations", "2",
                 "--gradient_accumulation_steps", "4")
    assert res.returncode == 0, res.stderr[-2000:]
    assert (tmp_path / "out" / "metrics.jsonl").is_file()
    assert "--nproc_per_node=1" in res.stderr and "--h 720" not in res.stderr


def test_jagg_variant_env_vars(tmp_path):
    env, stub = stubbed_run(tmp_path, JAGG="1", JAGG_GROUPING="window", JAGG_ALPHA="index", JAGG_BACKWARD="split")
    assert run_sh(SCRIPTS["flux"], env, stub=stub).returncode == 0
    argv = recorded_argv(env)
    flags = dict(zip(argv[5:19:2], argv[6:19:2]))
    assert flags == {"--jagg_window": "4", "--jagg_frac": "0.6", "--jagg_mode": "jagg", "--jagg_grouping": "window",
                     "--jagg_alpha": "index", "--jagg_backward": "split", "--jagg_reuse_rollout": "on_policy"}


# The first JAGG author's Qwen-Image scripts: run_standard.sh / run_jagg.sh.
AUTHORS = dict(seed=42, train_batch_size=8, gradient_accumulation_steps=8, max_train_steps=2000, learning_rate=1e-5,
               mixed_precision="bf16", checkpointing_steps=25, allow_tf32=True, h=720, w=720, eta=0.3,
               sampler_seed=12627, max_grad_norm=10.0, weight_decay=1e-4, reward_terms=[("hpsv2", 1.0)], shift=3.0,
               use_group=True, timestep_fraction=0.6, init_same_noise=True, clip_range=0.1, adv_clip_max=5.0,
               gradient_checkpointing=True, selective_checkpointing=0.0)


@pytest.mark.parametrize("recipe, extra, jagg", [
    ("authors_standard", dict(sampling_steps=20, num_generations=8), None),
    ("authors_jagg", dict(sampling_steps=21, num_generations=12),
     dict(jagg_window=4, jagg_frac=1.0, jagg_mode="jagg", jagg_grouping="window", jagg_alpha="index",
          jagg_backward="split", jagg_reuse_rollout="off")),
])
def test_authors_recipes(tmp_path, recipe, extra, jagg):
    from jagg_patch.cli import add_jagg_args
    env, stub = stubbed_run(tmp_path, RECIPE=recipe)
    del env["OUTPUT_DIR"]  # the recipe's own default folder is checked below
    assert run_sh(SCRIPTS["qwenimage"], env, stub=stub).returncode == 0
    argv = recorded_argv(env)
    module = "dancegrpo.train_grpo_qwenimage"
    launcher = ["-m", module] if jagg is None else ["-m", "jagg_patch", module]
    assert argv[2:2 + len(launcher)] == launcher
    parser = importlib.import_module(module).build_parser()
    args = parse_args(parser if jagg is None else add_jagg_args(parser), argv[2 + len(launcher):])
    expected = dict(AUTHORS, **extra, **(jagg or {}))
    assert {k: getattr(args, k) for k in expected} == expected
    assert args.output_dir == f"data/outputs/grpo_qwenimage_{recipe}"   # the two runs do not share a folder
    # environment variables still win over the recipe
    env["NUM_GENERATIONS"] = "4"
    assert run_sh(SCRIPTS["qwenimage"], env, stub=stub).returncode == 0
    assert "--num_generations 4" in " ".join(recorded_argv(env))


def test_unknown_recipe_is_an_error(tmp_path):
    res = run_sh(SCRIPTS["qwenimage"], {"RECIPE": "authors"}, stub=make_stub(tmp_path))
    assert res.returncode == 2 and "RECIPE must be upstream, authors_standard or authors_jagg" in res.stderr


def test_lora_recipes(tmp_path):
    """LORA=1: Flux through upstream's LoRA entry module with its recipe (r 128, alpha 256, lr 3e-4,
    S 12, batch 2, GA 12, no EMA); Qwen-Image with the same adapter flags; JAGG=1 on top."""
    env, stub = stubbed_run(tmp_path, LORA="1")
    assert run_sh(SCRIPTS["flux"], env, stub=stub).returncode == 0
    argv = recorded_argv(env)
    assert argv[:4] == ["--standalone", "--nproc_per_node=8", "-m", "dancegrpo.train_grpo_flux_lora"]
    args = parse_args(importlib.import_module("dancegrpo.train_grpo_flux_lora").build_parser(), argv[4:])
    expected = dict(use_lora=True, lora_rank=128, lora_alpha=256, lora_target_modules="to_q,to_k,to_v,to_out.0",
                    learning_rate=3e-4, sampling_steps=12, train_batch_size=2, gradient_accumulation_steps=12,
                    use_ema=False)
    assert {k: getattr(args, k) for k in expected} == expected
    env.update(JAGG="1", LORA_RANK="16")
    assert run_sh(SCRIPTS["qwenimage"], env, stub=stub).returncode == 0
    argv = recorded_argv(env)
    assert argv[3:5] == ["jagg_patch", "dancegrpo.train_grpo_qwenimage"]
    args = parse_args(importlib.import_module("dancegrpo.train_grpo_qwenimage").build_parser(), argv[5 + 14:])
    assert (args.use_lora, args.lora_rank, args.lora_alpha, args.learning_rate) == (True, 16, 256, 3e-4)
    res = run_sh(SCRIPTS["flux"], {**env, "LORA": "yes"}, stub=stub)
    assert res.returncode == 2 and "LORA must be 0" in res.stderr


def test_engine_env_var(tmp_path):
    env, stub = stubbed_run(tmp_path, ENGINE="deepspeed")
    assert run_sh(SCRIPTS["flux"], env, stub=stub).returncode == 0
    argv = recorded_argv(env)
    i = argv.index("--engine")
    assert argv[i + 1] == "deepspeed" and argv[i + 2] == "--deepspeed_config"
    assert os.path.samefile(argv[i + 3], os.path.join(ROOT, "configs", "deepspeed", "zero2.json"))
    env.update(DEEPSPEED_CONFIG=os.path.join(ROOT, "configs", "deepspeed", "zero3.json"))
    assert run_sh(SCRIPTS["qwenimage"], env, stub=stub).returncode == 0
    assert recorded_argv(env)[recorded_argv(env).index("--deepspeed_config") + 1].endswith("zero3.json")
    res = run_sh(SCRIPTS["flux"], {**env, "ENGINE": "ddp"}, stub=stub)
    assert res.returncode == 2 and "ENGINE must be fsdp or deepspeed" in res.stderr


@pytest.mark.parametrize("model, expected", [
    ("flux", dict(sampling_steps=6, sde_window_size=3, sde_window_range=[0, 3], sde_type="cps", eta=0.8,
                  clip_range=1e-5, advantage="flow_grpo")),
    ("qwenimage", dict(sampling_steps=10, sde_window_size=2, sde_window_range=[0, 5], sde_type="flow_grpo", eta=1.2,
                       clip_range=1e-4, advantage="flow_grpo")),
])
def test_flow_grpo_fast_recipes(tmp_path, model, expected):
    """ALGO=flow_grpo_fast: Flow-GRPO-Fast's config per model on top of the
    model's recipe; with LORA=1 its LoRA rank 64 / alpha 128; a flag on the command line still wins."""
    module = "dancegrpo.train_grpo_" + model
    env, stub = stubbed_run(tmp_path, ALGO="flow_grpo_fast")
    assert run_sh(SCRIPTS[model], env, stub=stub).returncode == 0
    argv = recorded_argv(env)
    args = parse_args(importlib.import_module(module).build_parser(), argv[4:])
    assert {k: getattr(args, k) for k in expected} == expected
    env.update(LORA="1")
    assert run_sh(SCRIPTS[model], env, "--eta", "0.5", stub=stub).returncode == 0
    argv = recorded_argv(env)
    entry = module + ("_lora" if model == "flux" else "")
    args = parse_args(importlib.import_module(entry).build_parser(), argv[4:])
    assert (args.lora_rank, args.lora_alpha, args.eta, args.sde_window_size) == (64, 128, 0.5,
                                                                                   expected["sde_window_size"])


def test_unknown_algo_is_refused(tmp_path):
    env, stub = stubbed_run(tmp_path, ALGO="ppo")
    res = run_sh(SCRIPTS["flux"], env, stub=stub)
    assert res.returncode == 2 and "ALGO must be dancegrpo or flow_grpo_fast" in res.stderr
