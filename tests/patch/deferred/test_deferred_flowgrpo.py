"""Flow-GRPO's SD3 trainer, unedited, through `python -m jagg_patch.deferred` (the stand-in of its
scripts/train_sd3.py, tests/flowgrpo_standin: a tiny SD3Transformer2DModel in float64, peft LoRA, an
ml_collections config, accelerate on CPU, CFG with the uncond half detached, the KL term through
`transformer.module.disable_adapter()`, two optimizer steps per epoch, EMA; tests/flowgrpo_harness.py).

Against an independent float64 reference (tests/flowgrpo_reference.py: the sde kernel, the guidance, the
PPO and KL loss written out; the groups in tests/deferred_loops.jagg_reference):
- the stand-in as it is == every row backpropagated with its own signal (1e-12); its signals == the
  reference's own (float32's rounding: upstream computes the log-density in float32);
- through the launcher == the reference's JAGG gradient (1e-12), and not vanilla's;
- one process (beta 0: upstream's KL pass needs DDP's `.module`) and two DDP ranks under accelerate's
  multi-CPU mode on gloo (beta > 0, one synced backward per rank per flush), cfg on and off, LoRA and
  full weights, a GradScaler's ordering;
- Flow-GRPO's own `info` unchanged, the proxy's counts beside it in the output folder, the checkpoint
  saved through accelerator.unwrap_model; the launch lines (torchrun, accelerate launch) end to end.
"""
import json
import os
import subprocess
import sys
import types

import pytest
import torch
from flowgrpo_harness import ROOT, SCRIPT, run_case, run_launcher, run_plain, with_grad_scaler
from helpers import REPO_ROOT, read_jsonl, relative_error

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")
FLOAT32 = 1e-6   # the stand-in's log-density is float32 (upstream's .float()): its signals carry float32's rounding

# name -> (the stand-in's flags, the launcher's JAGG flags, the reference's settings)
ONE_PROCESS = {
    "cfg_lora_w3": (["--config.train.cfg=True", "--config.use_lora=True", "--config.train.beta=0"],
                    ["--jagg_window", "3", "--jagg_frac", "1"], dict(window=3, jagg_frac=1.0)),
    "nocfg_full_w3_frac06": (["--config.train.cfg=False", "--config.use_lora=False", "--config.train.beta=0"],
                             ["--jagg_window", "3", "--jagg_frac", "0.6"], dict(window=3, jagg_frac=0.6)),
}


def reference_settings(window, jagg_frac, alpha="timestep"):
    return types.SimpleNamespace(window=window, jagg_frac=jagg_frac, mode="jagg", alpha=alpha)


@pytest.fixture(scope="module", params=list(ONE_PROCESS))
def one_process(request, tmp_path_factory):
    flags, jagg_flags, settings = ONE_PROCESS[request.param]
    workdir = tmp_path_factory.mktemp(request.param)
    return request.param, workdir, run_case(flags, jagg_flags, reference_settings(**settings), str(workdir))


def max_error(got, ref):
    assert len(got) == len(ref) == 2   # two optimizer steps per epoch
    return max(relative_error(a, b) for a, b in zip(got, ref))


def test_the_trainer_as_it_is_equals_the_float64_reference(one_process):
    _, _, r = one_process
    assert max_error(r["plain"], r["ref_vanilla"]) < 1e-12
    assert r["signal_error"] < FLOAT32
    assert max_error(r["plain"], r["ref_vanilla_own_signals"]) < FLOAT32


def test_through_the_launcher_equals_the_jagg_reference(one_process):
    name, workdir, r = one_process
    assert max_error(r["jagg"], r["ref_jagg"]) < 1e-12
    assert max_error(r["jagg"], r["ref_jagg_own_signals"]) < FLOAT32
    assert max_error(r["jagg"], r["plain"]) > 1e-3   # JAGG's gradient is not vanilla's
    assert r["jagg_forwards"] < r["plain_forwards"] == 2 * 2 * 5   # 2 batches x 5 trained steps per optimizer step
    first, second = read_jsonl(workdir / "jagg" / "jagg_metrics.jsonl")
    assert first["file"] == "train_sd3.py" and first["flush"] == 1 and second["flush"] == 2
    assert first["world_size"] == second["world_size"] == 1
    rows = first["deferred_rows_deferred"]
    # the rollout's outputs are on-policy until the first optimizer step, then forwarded again
    assert first["deferred_forwards_reused"] == rows and first["deferred_forwards_nograd"] == 0
    assert second["deferred_forwards_nograd"] == rows and second["deferred_forwards_reused"] == 0
    cfg = name.startswith("cfg")
    assert rows == 2 * 2 * 5 * (2 if cfg else 1)   # 2 batches of 2 samples, 5 steps, [uncond; cond] with cfg
    # the detached uncond half's endpoints carry no signal and are not replayed
    assert (first["deferred_zero_rows"] == first["deferred_endpoint_rows"]) if cfg else first["deferred_zero_rows"] == 0
    if name.endswith("frac06"):   # W 3 over 5 trained steps: [3 JAGG, 2 exact] per sample
        assert first["deferred_exact/routed_exact"] == 2 * 2 * 2 and first["deferred_jagg_groups"] == 4
    # the cost model's rows per sample (jagg_patch.tools.cost_flowgrpo) are what the proxy counted: 8 samples
    from jagg_patch.tools.cost_flowgrpo import flowgrpo_passes
    settings = ONE_PROCESS[name][2]
    predicted = flowgrpo_passes(settings["window"], settings["jagg_frac"], steps=6, trained=5, cfg=cfg,
                                kl=False)["deferred + reuse"]
    assert sum(line["deferred_forwards_grad"] for line in (first, second)) == 8 * predicted.grad
    assert first["deferred_forwards_nograd"] + second["deferred_forwards_nograd"] == 8 * predicted.nograd


def test_its_info_and_checkpoint_are_its_own(one_process):
    """lr 0: the update's forwards are the same values with or without the proxy, so Flow-GRPO's own info
    (approx_kl, clipfrac, policy_loss, ...) is line for line the unpatched run's; the proxy's counts are
    beside it in the output folder; the checkpoint is saved through accelerator.unwrap_model."""
    name, workdir, _ = one_process
    plain, jagg = read_jsonl(workdir / "plain" / "log.jsonl"), read_jsonl(workdir / "jagg" / "log.jsonl")
    assert plain == jagg and sum("policy_loss" in line for line in jagg) == 2
    assert (workdir / "jagg" / "jagg_metrics.jsonl").is_file()
    saved = "adapter_model.safetensors" if "lora" in name else "diffusion_pytorch_model.safetensors"
    from safetensors.torch import load_file
    plain_ckpt, jagg_ckpt = (load_file(str(workdir / run / "checkpoints" / "checkpoint-2" / "lora" / saved))
                             for run in ("plain", "jagg"))
    assert plain_ckpt.keys() == jagg_ckpt.keys() and all(torch.equal(plain_ckpt[k], jagg_ckpt[k]) for k in plain_ckpt)


def test_two_inner_epochs_equal_the_reference(tmp_path):
    """train.num_inner_epochs 2: the epoch's samples trained twice, four optimizer steps; only the first
    step's rows are on-policy (the rollout's outputs taken), every later one is forwarded again."""
    r = run_case(["--config.train.num_inner_epochs=2", "--config.train.beta=0"],
                 ["--jagg_window", "3", "--jagg_frac", "1"], reference_settings(3, 1.0), str(tmp_path))
    assert len(r["plain"]) == len(r["jagg"]) == 4
    assert max(relative_error(a, b) for a, b in zip(r["plain"], r["ref_vanilla"])) < 1e-12
    assert max(relative_error(a, b) for a, b in zip(r["jagg"], r["ref_jagg"])) < 1e-12
    lines = read_jsonl(tmp_path / "jagg" / "jagg_metrics.jsonl")
    assert [line["deferred_forwards_reused"] > 0 for line in lines] == [True, False, False, False]


def test_a_grad_scaler_is_flushed_before_accelerate_unscales(tmp_path):
    """fp16 as accelerate runs it on a GPU (a GradScaler scales the loss, accelerate's clip unscales, the
    optimizer steps through the scaler): the proxy's signals arrive scaled and its flush runs before the
    unscale, so the gradient at the step is the unscaled run's (a flush after it would be 1024 x)."""
    flags = ["--config.train.beta=0"]
    plain, _, _ = run_plain(flags, str(tmp_path / "a"))
    jagg, _ = run_launcher(["--jagg_window", "3"], flags, str(tmp_path / "b"))
    with with_grad_scaler(2.0 ** 10) as scalers:
        scaled_plain, _, _ = run_plain([*flags, "--config.mixed_precision=fp16"], str(tmp_path / "c"))
        scaled_jagg, _ = run_launcher(["--jagg_window", "3"], [*flags, "--config.mixed_precision=fp16"],
                                      str(tmp_path / "d"))
    assert [s.get_scale() for s in scalers] == [1024.0, 1024.0]   # both runs scaled, no step skipped
    assert max_error(scaled_plain, plain) < 1e-15 and max_error(scaled_jagg, jagg) < 1e-15
    assert max_error(jagg, plain) > 1e-3


# ---------------------------------------------------------------- two DDP ranks (one torchrun launch)

@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """tests/dist/flowgrpo_ranks.py's settings (cfg on / off, beta 0.04, LoRA) on two ranks."""
    out = tmp_path_factory.mktemp("flowgrpo_ranks")
    env = dict(os.environ, OMP_NUM_THREADS="1", ACCELERATE_USE_CPU="true",
               PYTHONPATH=os.pathsep.join([REPO_ROOT, os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                          os.path.join(REPO_ROOT, "tests", "dist", "flowgrpo_ranks.py"), str(out)],
                         capture_output=True, text=True, timeout=900, env=env, cwd=str(out))
    assert run.returncode == 0, run.stderr[-4000:]
    return out


@pytest.mark.parametrize("case", ["cfg_kl_w3", "nocfg_kl_w5"])
@pytest.mark.slow
def test_two_ddp_ranks_equal_the_reference(two_ranks, case):
    ranks = [torch.load(two_ranks / f"{case}.rank{r}.pt", weights_only=False) for r in range(2)]

    def mean(key):   # DDP averages the ranks' gradients: so do the references of each rank's own rows
        return [(a + b) / 2 for a, b in zip(ranks[0][key], ranks[1][key])]

    assert max_error(ranks[1]["plain"], ranks[0]["plain"]) == 0.0
    assert max_error(ranks[0]["ref_jagg"], ranks[1]["ref_jagg"]) > 0.1   # the ranks trained different samples
    assert max_error(ranks[0]["plain"], mean("ref_vanilla")) < 1e-12
    assert max_error(ranks[0]["plain"], mean("ref_vanilla_own_signals")) < FLOAT32
    for rank in ranks:
        assert rank["signal_error"] < FLOAT32
        assert max_error(rank["jagg"], mean("ref_jagg")) < 1e-12
        assert max_error(rank["jagg"], rank["plain"]) > 1e-3
        # DDP's synced forward (and backward): vanilla at every call, the proxy once per flush
        assert rank["plain_forwards"] == 2 * 2 * 5 and rank["jagg_forwards"] == 2
    plain, jagg = (read_jsonl(two_ranks / case / run / "log.jsonl") for run in ("plain", "jagg"))
    assert plain == jagg and all(line["kl_loss"] > 0 for line in jagg if "kl_loss" in line)
    lines = read_jsonl(two_ranks / case / "jagg" / "jagg_metrics.jsonl")
    # summed over the ranks: 2 ranks x 2 batches x 2 samples x 5 steps, doubled with cfg
    assert len(lines) == 2 and lines[0]["deferred_rows_deferred"] == (80 if case.startswith("cfg") else 40)
    assert {line["world_size"] for line in lines} == {2}
    # several replay chunks per rank and flush, all but the last past DDP (as under no_sync): one synced each
    assert all(line["deferred_backward_calls"] > 2 * 1 for line in lines)


# ---------------------------------------------------------------- the launch lines, end to end

def launch(command, tmp_path, epochs):
    env = dict(os.environ, OMP_NUM_THREADS="1", ACCELERATE_USE_CPU="true", FLOWGRPO_STANDIN_EPOCHS=str(epochs),
               PYTHONPATH=os.pathsep.join([ROOT, REPO_ROOT]))   # flow_grpo as `pip install -e .` installs it
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert run.returncode == 0, run.stderr[-4000:]
    return run


def script_argv(save_dir, metrics_dir=True):
    """metrics_dir: --jagg_metrics_dir save_dir, else the metrics go where the script's accelerate project_dir
    (the stand-in's config.logdir, here save_dir/logs) is."""
    return ["--jagg_window", "3", *(["--jagg_metrics_dir", str(save_dir)] if metrics_dir else []),
            os.path.relpath(SCRIPT, ROOT), "--", "--config", "config/grpo.py:tiny_sd3", f"--config.save_dir={save_dir}",
            f"--config.logdir={save_dir / 'logs'}"]


@pytest.mark.slow
def test_torchrun_launch_line_trains_two_epochs(tmp_path):
    """`torchrun --nproc_per_node 2 -m jagg_patch.deferred ... scripts/train_sd3.py -- --config ...`, the
    recipe's learning rate, two epochs: four optimizer steps logged, four flushes beside them, the epoch's
    checkpoint."""
    save = tmp_path / "run"
    run = launch([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone", "-m",
                  "jagg_patch.deferred", *script_argv(save)], tmp_path, epochs=2)
    logged = [line for line in read_jsonl(save / "log.jsonl") if "policy_loss" in line]
    flushes = read_jsonl(save / "jagg_metrics.jsonl")
    # one summary line at the end, rank 0's, of the flushes summed over the ranks
    said = [line for line in run.stderr.splitlines() if line.startswith("jagg_patch.deferred: ")]
    rows = sum(line["deferred_rows_deferred"] for line in flushes)
    assert len(said) == 1 and said[0].startswith(f"jagg_patch.deferred: 4 flushes, {rows} rows deferred in "), said
    assert [line["step"] for line in logged] == [0, 1, 2, 3] and len(flushes) == 4
    # jagg_frac 0.6 (its default): [3 JAGG, 2 exact] per trajectory; nothing else trained exactly
    assert all(line["deferred_jagg_groups"] == line["deferred_exact_groups"] > 0 for line in flushes)
    assert all(line["deferred_exact_rows"] == line["deferred_exact/routed_exact"] for line in flushes)
    # each epoch's rollout is a new one: its first flush reuses the rollout's outputs, its second cannot
    assert [line["deferred_forwards_reused"] > 0 for line in flushes] == [True, False, True, False]
    assert logged[-1]["approx_kl"] > 0   # the policy moved: the second step's ratios are no longer 1
    assert (save / "checkpoints" / "checkpoint-2" / "lora" / "adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_accelerate_launch_line_runs(tmp_path):
    """`accelerate launch --multi_gpu --num_processes 2 -m jagg_patch.deferred ...` (accelerate's multi-CPU
    mode with ACCELERATE_USE_CPU=true): one epoch, two flushes."""
    save = tmp_path / "run"
    run = launch([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                  "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m",
                  "jagg_patch.deferred", *script_argv(save, metrics_dir=False)], tmp_path, epochs=1)
    # no --jagg_metrics_dir: beside the script's own outputs, in the project_dir it names to accelerate, said
    assert len(read_jsonl(save / "logs" / "jagg_metrics.jsonl")) == 2
    assert f"one line per flush in {save / 'logs' / 'jagg_metrics.jsonl'}" in run.stdout
    assert sum("policy_loss" in line for line in read_jsonl(save / "log.jsonl")) == 2


@pytest.mark.slow
def test_the_benchmark_counts_what_the_cost_model_predicts(tmp_path):
    """benchmarks/flowgrpo_deferred.py, one repetition: the three modes' rows are the cost model's (per
    sample, 8 samples an epoch) and their activation peaks vanilla's; its times are not asserted (they are
    measured, not tested)."""
    run = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "benchmarks", "flowgrpo_deferred.py"), "--reps", "1",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=900,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert run.returncode == 0, run.stderr[-3000:]
    median = json.loads((tmp_path / "flowgrpo_deferred.json").read_text())["median"]
    from jagg_patch.tools.cost_flowgrpo import flowgrpo_passes
    predicted = flowgrpo_passes(3, 1.0, kl=False)
    for mode, name in (("vanilla", "vanilla"), ("deferred", "deferred"), ("deferred_reuse", "deferred + reuse")):
        assert median[mode]["rows_grad"] == 8 * predicted[name].grad, mode
        assert median[mode]["rows_nograd"] == 8 * predicted[name].nograd, mode
    assert median["deferred_reuse"]["rows_reused"] == 8 * 9 and "| deferred_reuse |" in run.stdout
    # the replay runs chunks no larger than the loop's calls: the bytes saved for backward peak as vanilla's
    vanilla_peak = median["vanilla"]["activation_peak_mb"]
    assert vanilla_peak > 0 and all(m["activation_peak_mb"] <= 1.05 * vanilla_peak for m in median.values())
