"""DanceGRPO's Stable Diffusion trainer (the stand-in of fastvideo/train_grpo_sd.py: an absl main(_) with an
ml_collections config, accelerate on CPU, a tiny UNet2DConditionModel, DDIM) run as it is, the model
accelerate prepares behind the deferred proxy (jagg_patch.deferred.prepare), float64:
- the proxy in mode exact gives its own unpatched loop's gradient;
- JAGG gives an independent float64 JAGG reference built from its own rows' signals (tests/deferred_loops.py:
  a recorder written there, the groups written out), where every sample of the epoch starts from one
  latent, so the first step's rows are trained exactly; with train.cfg on and off, clip_sample on and off;
- `python -m jagg_patch.upstream train_grpo_sd.py` end to end.
"""
import os
import subprocess
import sys

import pytest

from deferred_loops import SignalRecorder, jagg_reference
from helpers import REPO_ROOT, read_jsonl, relative_error
from jagg_patch import JaggConfig
from jagg_patch.upstream import load_trainer, run_main_block
from prepare_hooks import at_prepare, fresh_absl_flags
from upstream_harness import STANDIN, in_tmp  # noqa: F401

SD = os.path.join(STANDIN, "fastvideo", "train_grpo_sd.py")
CONFIG = os.path.join(STANDIN, "fastvideo", "config_sd", "base.py")
BATCH, TRAINED = 2, 4   # the config's train.batch_size, and int(6 steps * 0.8)
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def run_sd(flags, config=None, replace=None):
    """The stand-in's main block in this process: (its gradients at each optimizer step, the proxies made)."""
    fresh_absl_flags()
    module = load_trainer(SD)
    installed = None
    if config is not None:
        from jagg_patch.deferred.prepare import install_at_prepare
        installed = install_at_prepare(config)
    try:
        with at_prepare(replace) as (grads, _, _):
            with pytest.raises(SystemExit) as done:   # absl's app.run exits when main returns
                run_main_block(module, ["--config", CONFIG, "--config.train.learning_rate=0.0", *map(str, flags)])
    finally:
        if installed is not None:
            installed.remove()
    assert done.value.code in (None, 0)
    return grads, (installed.proxies if installed else [])


def labels_of(calls, cfg, timesteps):
    """(sample, half, step) of every row of every update call, as the stand-in lays them out: the samples
    in consecutive batches (no shuffle), TRAINED calls a batch, [uncond rows; cond rows] with cfg."""
    out = []
    for c, (args, kwargs, leaf) in enumerate(calls):
        base = (c // TRAINED) * BATCH
        t = args[1].tolist()
        rows = [(base + r % BATCH, r // BATCH if cfg else 1) for r in range(len(t))]
        out.append([(sample, half, timesteps.index(int(step))) for (sample, half), step in zip(rows, t)])
    return out


def unet_row(args, kwargs, r):
    sample, timestep, embeds = args
    return {"sample": sample[r:r + 1], "timestep": timestep[r:r + 1], "encoder_hidden_states": embeds[r:r + 1]}


def reference(flags, config, cfg, identical=lambda label: False):
    """The reference's gradients; `identical` says which rows it trains apart from their samples' groups
    (none by default; the first step's rows, which start from the epoch's one latent, to tell the two apart)."""
    recorders = []

    def record(model):
        recorders.append(SignalRecorder(model))
        return recorders[0]

    grads, _ = run_sd(flags, replace=record)
    recorder = recorders[0]
    from diffusers import DDIMScheduler
    scheduler = DDIMScheduler(num_train_timesteps=1000, steps_offset=1)
    scheduler.set_timesteps(6)
    labels = labels_of(recorder.calls, cfg, [int(t) for t in scheduler.timesteps])
    steps = [TRAINED * (i + 1) for i in range(len(grads))]   # an optimizer step after every batch (GA 1 batch)
    return jagg_reference(recorder.model, recorder.calls, labels, steps, config, identical, unet_row)


@pytest.mark.parametrize("cfg, clip_sample", [(True, False), (False, True), (True, True)])
def test_sd_trainer_deferred_equals_the_reference(cfg, clip_sample):
    flags = [f"--config.train.cfg={cfg}", f"--config.pretrained.clip_sample={clip_sample}",
             "--config.train.gradient_accumulation_steps=1"]
    config = JaggConfig(window=3, jagg_frac=1.0)
    got, (proxy,) = run_sd(flags, config)
    ref = reference(flags, config, cfg)
    assert len(got) == len(ref) == 2   # two batches, an optimizer step after each
    assert max(relative_error(a, b) for a, b in zip(got, ref)) < 1e-12
    stats = proxy.stats
    assert len(stats) == 2 and all(s.jagg_groups > 0 for s in stats)
    # the epoch's one latent: the first step's rows are shared, and placed by the flush's counts
    assert all(s.shared_placed > 0 and s.exact_rows == s.rows_exact.get("routed exact", 0) for s in stats)
    if cfg and not clip_sample:   # the reference that trains the first step's rows apart differs
        apart = reference(flags, config, cfg, identical=lambda label: label[2] == 0)
        assert relative_error(got[0], apart[0]) > 1e-3


def test_sd_trainer_exact_mode_is_its_own_loop():
    flags = ["--config.train.gradient_accumulation_steps=2"]
    own, _ = run_sd(flags)
    got, (proxy,) = run_sd(flags, JaggConfig(mode="exact"))
    assert len(own) == len(got) == 1 and relative_error(got[0], own[0]) < 1e-12
    assert proxy.stats[0].rows_exact == {"mode exact": proxy.stats[0].rows_deferred}


@pytest.mark.slow
def test_the_launcher_runs_the_sd_trainer_deferred(tmp_path):
    run = subprocess.run([sys.executable, "-m", "jagg_patch.upstream", "--jagg_window", "3", "--jagg_frac", "1",
                          SD, "--config", CONFIG], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO_ROOT))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "epoch 0 approx_kl" in run.stdout   # upstream's own loop ran
    (line,) = read_jsonl(tmp_path / "jagg_metrics.jsonl")   # one flush: GA 2 batches
    assert line["file"] == "train_grpo_sd.py" and line["deferred_jagg_groups"] > 0
    assert line["deferred_rows_deferred"] == 4 * BATCH * 2 * TRAINED // 2 and (tmp_path / "reward.txt").is_file()


def test_the_generic_launcher_runs_the_sd_trainer_as_the_prepare_hook_does(tmp_path, monkeypatch):
    """`python -m jagg_patch.deferred SCRIPT [--jagg_* flags] -- [its flags]` (in this process): the script as
    __main__, its absl flags untouched, the proxy at accelerate's prepare: every optimizer step's gradient is
    the one install_at_prepare gives in run_sd (== the independent reference, above), one jagg_metrics line
    per flush in --jagg_metrics_dir."""
    flags = ["--config.train.gradient_accumulation_steps=1"]
    expected, _ = run_sd(flags, JaggConfig(window=3, jagg_frac=1.0))
    fresh_absl_flags()
    monkeypatch.syspath_prepend(STANDIN)   # the stand-in checkout's fastvideo package, as an installed one
    from jagg_patch.deferred.__main__ import main
    with at_prepare() as (grads, _, _):
        with pytest.raises(SystemExit) as done:   # absl's app.run exits when main returns
            main([SD, "--jagg_window", "3", "--jagg_metrics_dir", str(tmp_path / "m"), "--jagg_frac", "1", "--",
                  "--config", CONFIG, "--config.train.learning_rate=0.0", *flags])
    assert done.value.code in (None, 0)
    assert len(grads) == len(expected) == 2 and max(relative_error(a, b) for a, b in zip(grads, expected)) < 1e-12
    lines = read_jsonl(tmp_path / "m" / "jagg_metrics.jsonl")
    assert [line["flush"] for line in lines] == [1, 2] and {line["window"] for line in lines} == {3}
    assert all(line["file"] == "train_grpo_sd.py" and line["deferred_jagg_groups"] > 0 for line in lines)
