"""--engine deepspeed in single processes: weights equal the FSDP-less plain run, resume is
bit-exact, LoRA works under it, bad configurations stop before any model is loaded. The runs share
one process of their own (helpers.run_mains): DeepSpeed creates a process group and sets RANK /
WORLD_SIZE / MASTER_* in the environment, which must not leak into the test process.
(2-rank equality: tests/engines/test_distributed.py.)"""
import json
import os
import sys

import pytest
import torch
from safetensors.torch import load_file
from helpers import REPO_ROOT, exit_threads_env, read_metrics, run_main, run_mains, threads_at_exit

ROOT = REPO_ROOT
CONFIGS = os.path.join(ROOT, "configs", "deepspeed")
SMALL = ["--train_batch_size", "2", "--num_generations", "4", "--gradient_accumulation_steps", "8",
         "--checkpointing_steps", "1"]
EMA = {2: ["--use_ema"], 3: []}   # the EMA under ZeRO-2 (ZeRO-3 refuses it)
STAGES = ((2, 0.0), (3, 1e-5))    # stage, tolerance against the plain run
LORA = ["--use_lora", "--lora_rank", 4, "--lora_alpha", 8, "--learning_rate", "1e-2", "--max_train_steps", 2]
AUTO = ["--jagg_window", 3, "--jagg_frac", "auto", "--jagg_monitor_every", 1, "--jagg_min_cos", 0.9,
        "--max_train_steps", 2]
BF16 = ["--mixed_precision", "bf16"]   # on CPU: the config's bf16 section stays on (a float32 run turns it off)
JAGG = ["--jagg_window", 4, "--jagg_frac", 1]
# Measured at step 1 only: after a resume from checkpoint-1, step 2 runs on the routing the checkpoint kept.
AUTO_ONCE = ["--jagg_window", 3, "--jagg_frac", "auto", "--jagg_monitor_every", 100, "--jagg_min_cos", 0.9]


def child_env():
    """One thread (runs stay bit-comparable), no rank variables of an outer launch."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def zero(stage):
    return ["--engine", "deepspeed", "--deepspeed_config", os.path.join(CONFIGS, f"zero{stage}.json")]


@pytest.fixture(scope="module")
def runs(cache_dir, tmp_path_factory):
    """Every training run of this module, in order (a resume after the run it resumes), in one
    process: {name: (exit status, stdout, stderr)} and the folder of each run (folder / name)."""
    folder = tmp_path_factory.mktemp("deepspeed_runs")

    def run(out, *flags, launcher=()):
        return [*launcher, "dancegrpo.train_grpo_flux", "--preset", "tiny", "--cache_dir", cache_dir,
                "--output_dir", folder / out, *SMALL, *flags]

    plan = {"plain": run("plain", "--max_train_steps", 2),
            "lora_plain": run("lora_plain", *LORA), "lora_z2": run("lora_z2", *LORA, *zero(2)),
            "auto_plain": run("auto_plain", *AUTO, launcher=["jagg_patch"]),
            "auto_z2": run("auto_z2", *AUTO, *zero(2), launcher=["jagg_patch"]),
            "once_z2": run("once_z2", *AUTO_ONCE, *zero(2), "--max_train_steps", 2, launcher=["jagg_patch"]),
            "once_z2_part": run("once_z2_part", *AUTO_ONCE, *zero(2), "--max_train_steps", 1, launcher=["jagg_patch"]),
            "once_z2_resumed": run("once_z2_part", *AUTO_ONCE, *zero(2), "--max_train_steps", 2,
                                   "--resume_from_checkpoint", "latest", launcher=["jagg_patch"]),
            "z2_bf16": run("z2_bf16", *zero(2), *BF16, "--max_train_steps", 2),
            "z2_bf16_jagg": run("z2_bf16_jagg", *zero(2), *BF16, *JAGG, "--max_train_steps", 2, launcher=["jagg_patch"]),
            "jagg_plain": run("jagg_plain", *JAGG, "--max_train_steps", 2, launcher=["jagg_patch"])}
    for stage, _ in STAGES:
        plan[f"z{stage}"] = run(f"z{stage}", *zero(stage), "--max_train_steps", 3, *EMA[stage])
        plan[f"z{stage}_part"] = run(f"z{stage}_part", *zero(stage), "--max_train_steps", 2, *EMA[stage])
        plan[f"z{stage}_resumed"] = run(f"z{stage}_part", *zero(stage), "--max_train_steps", 3, *EMA[stage],
                                        "--resume_from_checkpoint", "latest")
    results = run_mains(plan, folder / "logs", env=exit_threads_env(child_env(), folder / "threads"))
    for name, (code, out, err) in results.items():
        assert code == 0, (name, out[-2000:] + err[-3000:])
    return results, folder


def weights(folder, name="diffusion_pytorch_model.safetensors"):
    return load_file(os.path.join(folder, name))


def max_diff(a, b):
    assert set(a) == set(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.slow
def test_zero_stages_train_like_the_plain_run_and_resume_bit_exact(runs):
    """Measured: ZeRO-2 bit-equal to the plain single-process run after 2 steps, ZeRO-3 9.7e-7 off
    (tolerance 1e-5: the reduction order of another CPU may differ; a step moves weights ~1e-2); a
    resume (2 steps, then 1 more from checkpoint-2-0) bit-equal to 3 unbroken steps, with the EMA
    under ZeRO-2."""
    results, folder = runs
    plain = weights(folder / "plain" / "checkpoint-2-0")
    for stage, tol in STAGES:
        _, stdout, _ = results[f"z{stage}_resumed"]
        assert f"(DeepSpeed ZeRO-{stage} fp32)" in stdout and "computes in float32" in stdout
        # CPU runs are fp32 (the config's bf16 is turned off): 81664 parameters x 4 B = 0.312 MiB held and
        # as gradients on one rank, 12 B each of optimizer (fp32 master copy + two moments) = 0.935 MiB.
        assert "training state: params 0.312 MiB + grads 0.312 MiB + optimizer 0.935 MiB" in stdout
        assert max_diff(weights(folder / f"z{stage}" / "checkpoint-2-0"), plain) <= tol
        assert os.path.isdir(folder / f"z{stage}" / "checkpoint-2-0" / "deepspeed")
        part, full = folder / f"z{stage}_part" / "checkpoint-3-0", folder / f"z{stage}" / "checkpoint-3-0"
        assert max_diff(weights(part), weights(full)) == 0.0
        if EMA[stage]:
            assert max_diff(weights(part / "ema"), weights(full / "ema")) == 0.0


@pytest.mark.parametrize("name,reference", [("z2_bf16", "plain"), ("z2_bf16_jagg", "jagg_plain")])
@pytest.mark.slow
def test_zero2_in_bf16_on_cpu_holds_bf16_weights_and_computes_in_bf16(runs, cache_dir, name, reference):
    """--mixed_precision bf16 keeps the config's bf16 on CPU: the engine holds bf16 parameters and
    gradients (half the bytes of the float32 run; the optimizer's fp32 master copy and moments stay
    12 B a parameter) and the transformer computes under bf16 autocast; vanilla and JAGG train (their
    weights move) and end elsewhere than the float32 run of the same flags."""
    results, folder = runs
    _, stdout, _ = results[name]
    assert "(DeepSpeed ZeRO-2 bf16)" in stdout and "computes in bf16 autocast" in stdout
    assert "training state: params 0.156 MiB + grads 0.156 MiB + optimizer 0.935 MiB" in stdout
    from dancegrpo.presets import materialize_preset
    bf16, float32 = weights(folder / name / "checkpoint-2-0"), weights(folder / reference / "checkpoint-2-0")
    assert {v.dtype for v in bf16.values()} == {torch.bfloat16}   # the engine's own (bf16) parameters, exported
    start = weights(os.path.join(materialize_preset("flux", "tiny", cache_dir), "transformer"))
    as_bf16 = lambda state: {k: v.to(torch.bfloat16).float() for k, v in state.items()}  # noqa: E731
    bf16 = as_bf16(bf16)
    assert max_diff(bf16, as_bf16(start)) > 1e-3                     # trained
    assert max_diff(bf16, as_bf16(float32)) > 1e-3                   # not the float32 run, rounded


@pytest.mark.slow
def test_the_runs_release_their_process_groups_zero3s_included(runs):
    """DeepSpeed's gradient hooks sit on autograd's nodes, outside the garbage collector: unless the
    engine is destroyed (DeepSpeedEngine.destroy, at close) they keep it, its groups and their gloo
    threads alive to the exit of the process that ran these runs one after another. ZeRO-3 keeps its
    engine after destroy() through two module-level references of DeepSpeed's (its forward-module
    stack, an lru_cache of the parameter coordinator), which close() drops: no gloo thread is left."""
    results, folder = runs
    (threads,) = threads_at_exit(folder / "threads").values()
    assert len([name for name in results if name.startswith("z3")]) == 3
    assert threads.count("gloo_tcp_loop") == 0 and threads.count("pt_gloo_runloop") == 0, threads


@pytest.mark.slow
def test_lora_under_zero2_equals_lora_without_it(runs):
    _, folder = runs
    name = "pytorch_lora_weights.safetensors"
    a, b = weights(folder / "lora_plain" / "checkpoint-2-0", name), weights(folder / "lora_z2" / "checkpoint-2-0", name)
    assert max_diff(a, b) == 0.0 and any(v.abs().max() > 0 for k, v in a.items() if "lora_B" in k)


@pytest.mark.slow
def test_jagg_auto_under_zero2_measures_routes_and_trains_as_without_deepspeed(runs):
    """--jagg_frac auto with the monitor at every step: under ZeRO-2 the monitor takes its gradients
    past the engine's buffers (engines.probe.AutogradProbe); its cosines, the routing they choose and
    the weights after 2 steps are those of the run without DeepSpeed (whose monitor reads .grad)."""
    _, folder = runs
    records = {}
    for name in ("auto_plain", "auto_z2"):
        records[name] = read_metrics(folder / name)
    for plain, z2 in zip(records["auto_plain"], records["auto_z2"]):
        measured = sorted(k for k in plain if "_cos/" in k or "_relerr/" in k)
        assert measured and measured == sorted(k for k in z2 if "_cos/" in k or "_relerr/" in k)
        for key in measured:
            assert z2[key] == pytest.approx(plain[key], abs=1e-6), key
        assert z2["jagg_routed"] == plain["jagg_routed"]
        assert (z2["monitor_forwards"], z2["monitor_backwards"]) == (plain["monitor_forwards"],
                                                                    plain["monitor_backwards"]) != (0, 0)
    assert any(r["jagg_routed"] for r in records["auto_z2"])   # it routed something to JAGG
    assert max_diff(weights(folder / "auto_z2" / "checkpoint-2-0"), weights(folder / "auto_plain" / "checkpoint-2-0")) == 0.0


@pytest.mark.slow
def test_jagg_auto_resumes_its_routing_under_zero2(runs):
    """1 step, then resumed from checkpoint-1 to 2 under ZeRO-2: step 2 runs on the routing step 1
    chose (saved with the checkpoint by rank 0, read back as every engine's), as the unbroken run."""
    _, folder = runs
    routed = {}
    for name in ("once_z2", "once_z2_part"):
        routed[name] = [r["jagg_routed"] for r in read_metrics(folder / name)]
    assert routed["once_z2"] == routed["once_z2_part"] and routed["once_z2"][1] > 0
    part, full = folder / "once_z2_part" / "checkpoint-2-0", folder / "once_z2" / "checkpoint-2-0"
    assert max_diff(weights(part), weights(full)) == 0.0


BAD = [
    (["--engine", "deepspeed"], "needs --deepspeed_config FILE"),
    (["--engine", "deepspeed", "--deepspeed_config", "/nowhere.json"], "does not exist"),
    (["--engine", "deepspeed", "--deepspeed_config", "{bad}"], "not valid JSON"),
    (["--engine", "deepspeed", "--deepspeed_config", "{stage5}"], "stage must be 0-3"),
    (["--engine", "deepspeed", "--deepspeed_config", "{offload}"], "compiled CPU Adam"),
    (["--deepspeed_config", "{zero3}"], "add --engine deepspeed"),
    (["--engine", "deepspeed", "--deepspeed_config", "{zero3}", "--use_ema"], "not supported with ZeRO-3"),
]


def _bad_config_files(tmp_path):
    files = {"bad": "{not json", "stage5": json.dumps({"zero_optimization": {"stage": 5}}),
             "offload": json.dumps({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})}
    paths = {k: str(tmp_path / f"{k}.json") for k in files}
    for k, text in files.items():
        (tmp_path / f"{k}.json").write_text(text)
    paths["zero3"] = os.path.join(CONFIGS, "zero3.json")
    return paths


@pytest.mark.parametrize("flags,message", BAD)
def test_bad_deepspeed_settings_are_refused_at_parse_time(make_args, tmp_path, capsys, flags, message):
    paths = _bad_config_files(tmp_path)
    with pytest.raises(SystemExit) as stop:
        make_args(*[f.format(**paths) if "{" in f else f for f in flags])
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_a_bad_config_stops_the_cli_with_one_line_before_any_work(cache_dir, tmp_path, capsys):
    code = run_main("dancegrpo.train_grpo_flux", "--preset", "tiny", "--cache_dir", cache_dir, "--output_dir",
                    tmp_path / "run", *SMALL, "--max_train_steps", 1, "--engine", "deepspeed", "--deepspeed_config",
                    _bad_config_files(tmp_path)["stage5"])
    err = capsys.readouterr().err
    assert code == 2 and "stage must be 0-3" in err and "Traceback" not in err
    assert not os.path.exists(tmp_path / "run")


def test_missing_deepspeed_is_named(monkeypatch):
    from types import SimpleNamespace
    from dancegrpo.engines import validate_engine_args
    monkeypatch.setitem(sys.modules, "deepspeed", None)   # import deepspeed -> ImportError
    with pytest.raises(ValueError, match="pip install deepspeed"):
        validate_engine_args(SimpleNamespace(engine="deepspeed", deepspeed_config="x.json", use_ema=False))


@pytest.mark.parametrize("settings, precision, said", [
    ({"fp16": {"enabled": True}}, None, "the DeepSpeed config's fp16 is turned off on CPU"),
    ({"bf16": {"enabled": True}}, None, "the DeepSpeed config's bf16 is turned off on CPU"),
    ({"bf16": {"enabled": True}}, "bf16", None),
    ({}, None, None)], ids=["fp16", "bf16-float32-run", "bf16-run", "none"])
def test_a_precision_of_the_config_that_cpu_turns_off_is_said(settings, precision, said, capsys):
    """An fp16 config on CPU ran float32 without a word; the engine now says what it turned off."""
    import argparse
    import torch
    from dancegrpo.engines.deepspeed import engine_config
    args = argparse.Namespace(max_grad_norm=1.0, mixed_precision=precision)
    config = engine_config(settings, args, torch.device("cpu"))
    out = capsys.readouterr().out
    assert not config["fp16"]["enabled"] and (said in out if said else "notice" not in out), out
