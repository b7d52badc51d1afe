"""Nothing lost, nothing silently wrong: output-folder locks, resume, NaN stops, metrics after a
resume, signals, early checks and disk. Each test reproduces a failure a user met."""
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from dancegrpo.utils import checkpoint as ckpt
from dancegrpo.utils import optimizer_shards
from dancegrpo import train_grpo_flux, train_grpo_qwenimage
from dancegrpo.errors import ConfigError, DiskFullError, MissingFileError, NonFiniteError
from dancegrpo.run.rundir import RunLock

from helpers import FAST, REPO_ROOT, exit_threads_env, gloo_threads_at_exit, read_metrics, run_main, threads_at_exit

WEIGHTS = "diffusion_pytorch_model.safetensors"
REPO = REPO_ROOT




def weights(folder):
    return load_file(os.path.join(folder, WEIGHTS))


def cli(module, *argv, **kw):
    return subprocess.Popen([sys.executable, "-m", module, *map(str, argv)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def wait_for_steps(folder, n, proc, limit=120):
    """Block until metrics.jsonl in `folder` holds n lines (or the process ended)."""
    path = os.path.join(folder, "metrics.jsonl")
    deadline = time.time() + limit
    while time.time() < deadline and proc.poll() is None:
        if os.path.isfile(path) and open(path).read().count("\n") >= n:
            return
        time.sleep(0.2)
    raise AssertionError(f"{path} did not reach {n} steps: {proc.poll()} {proc.stderr.read() if proc.poll() else ''}")


# ------------------------------------------------------------------ 1. one run per output folder
def test_a_locked_output_folder_is_refused_naming_the_holder(make_args, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from dancegrpo.run.rundir import RunLock; "
                               f"RunLock({str(out)!r}, 'other').acquire(); print('locked', flush=True); "
                               "time.sleep(60)"], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ConfigError, match=rf"in use by another run \(pid {holder.pid} on .*, started "):
            train_grpo_flux.main(make_args(*FAST, "--max_train_steps", 1, "--output_dir", out))
        assert not os.path.exists(out / "metrics.jsonl")
    finally:
        holder.kill()
        holder.wait()
    # The holder died without releasing: its lock is stale and is taken over with a notice.
    train_grpo_flux.main(make_args(*FAST, "--max_train_steps", 1, "--output_dir", out))
    assert [r["step"] for r in read_metrics(out)] == [1]


def test_stale_lock_notice(make_args, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / ".run.lock").write_text(json.dumps({"pid": 999999, "host": "gone", "started": "2026-01-01T00:00:00"}))
    train_grpo_flux.main(make_args(*FAST, "--max_train_steps", 1, "--output_dir", out))
    printed = capsys.readouterr().out
    assert "took over a stale lock" in printed and "pid 999999 on gone" in printed


def test_a_used_folder_is_refused_unless_resumed_or_overwritten(make_args, tmp_path):
    out = tmp_path / "out"
    train_grpo_flux.main(make_args(*FAST, "--max_train_steps", 2, "--output_dir", out))
    before = read_metrics(out)
    with pytest.raises(ConfigError, match="already holds a run.*--resume_from_checkpoint latest.*"
                                          "--overwrite_output_dir.*another --output_dir"):
        train_grpo_flux.main(make_args(*FAST, "--max_train_steps", 2, "--output_dir", out))
    assert read_metrics(out) == before  # nothing appended, nothing overwritten
    train_grpo_flux.main(make_args(*FAST, "--max_train_steps", 1, "--output_dir", out, "--overwrite_output_dir"))
    assert [r["step"] for r in read_metrics(out)] == [1]
    assert sorted(p for p in os.listdir(out) if p.startswith("checkpoint")) == ["checkpoint-1-0"]


@pytest.mark.slow
def test_resume_says_that_it_ignores_overwrite(make_args, tmp_path, capsys):
    """Both flags: the resume wins (the folder's files stay) and the run says so."""
    out = tmp_path / "out"
    train_grpo_flux.main(make_args(*FAST, "--max_train_steps", 1, "--output_dir", out))
    capsys.readouterr()
    train_grpo_flux.main(make_args(*FAST, "--max_train_steps", 2, "--output_dir", out, "--overwrite_output_dir",
                                   "--resume_from_checkpoint", "latest"))
    printed = capsys.readouterr().out
    assert "--overwrite_output_dir is ignored: the run resumes" in printed and str(out) in printed
    assert [r["step"] for r in read_metrics(out)] == [1, 2]


@pytest.mark.slow
def test_an_evaluation_keeps_the_checkpoints_it_reads(make_args, tmp_path, cache_dir, monkeypatch, capsys):
    """dancegrpo.evaluate holds a reader's lock on the run folder: a run started there with
    --overwrite_output_dir meanwhile is refused naming the reader (it deleted the checkpoints
    mid-evaluation), and --checkpoints_total_limit puts its pruning off; both work once it ends."""
    from dancegrpo import evaluate
    from dancegrpo.run.readers import ReaderLock
    out = tmp_path / "out"
    train_grpo_flux.main(make_args(*FAST, "--max_train_steps", 2, "--checkpointing_steps", 1, "--output_dir", out))
    refusals = []
    from dancegrpo import eval_run
    real_evaluate = eval_run.evaluate_checkpoint

    def evaluate_while_a_run_starts(*args, **kwargs):
        with pytest.raises(ConfigError) as refused:
            train_grpo_flux.main(make_args(*FAST, "--max_train_steps", 1, "--output_dir", out,
                                           "--overwrite_output_dir"))
        refusals.append(str(refused.value))
        return real_evaluate(*args, **kwargs)
    monkeypatch.setattr(eval_run, "evaluate_checkpoint", evaluate_while_a_run_starts)
    rows = evaluate.main(["--preset", "tiny", "--cache_dir", cache_dir, "--metrics", "jpeg", "--max_prompts", "1",
                          "--num_images_per_prompt", "1", "--output_dir", str(tmp_path / "eval"),
                          "--checkpoint", f"a={out / 'checkpoint-1-0'}", "--checkpoint", f"b={out / 'checkpoint-2-0'}"])
    assert len(rows) == 2 and len(refusals) == 2
    assert all(f"dancegrpo.evaluate (pid {os.getpid()}" in r and "Wait for it to finish" in r for r in refusals)
    assert [r["step"] for r in read_metrics(out)] == [1, 2]   # the run's files are untouched
    # Pruning waits for a reader too, and happens at the first save that finds the folder free.
    capsys.readouterr()
    with ReaderLock(str(out), "a test reader"):
        train_grpo_flux.main(make_args(*FAST, "--max_train_steps", 3, "--output_dir", out, "--resume_from_checkpoint",
                                       "latest", "--checkpoints_total_limit", 1, "--allow_config_change"))
    assert "old checkpoints in" in capsys.readouterr().out
    assert sorted(p for p in os.listdir(out) if p.startswith("checkpoint")) == [f"checkpoint-{n}-0" for n in (1, 2, 3)]
    train_grpo_flux.main(make_args(*FAST, "--max_train_steps", 4, "--output_dir", out, "--resume_from_checkpoint",
                                   "latest", "--checkpoints_total_limit", 1, "--allow_config_change"))
    assert sorted(p for p in os.listdir(out) if p.startswith("checkpoint")) == ["checkpoint-4-0"]
    train_grpo_flux.main(make_args(*FAST, "--max_train_steps", 1, "--output_dir", out, "--overwrite_output_dir"))
    assert [r["step"] for r in read_metrics(out)] == [1]


def test_the_lock_is_released_when_a_run_fails(make_args, tmp_path, monkeypatch):
    from dancegrpo.engines import fsdp
    monkeypatch.setattr(fsdp, "clip_grad_norm", lambda model, max_norm: float("nan"))
    out = tmp_path / "out"
    with pytest.raises(NonFiniteError):
        train_grpo_flux.main(make_args(*FAST, "--max_train_steps", 1, "--output_dir", out))
    RunLock(str(out), "next").acquire().release()  # would raise if the failed run still held it


# ------------------------------------------------------------------ 2. resume, both families
@pytest.mark.parametrize("module", [train_grpo_qwenimage, train_grpo_flux], ids=["qwenimage", "flux"])
@pytest.mark.slow
def test_resume_is_bit_exact(make_args, tmp_path, module):
    name = module.__name__

    def args(*extra):
        return make_args(*FAST, *extra, module=name)
    module.main(args("--max_train_steps", 3, "--output_dir", tmp_path / "a"))
    module.main(args("--max_train_steps", 2, "--output_dir", tmp_path / "b"))
    module.main(args("--max_train_steps", 3, "--output_dir", tmp_path / "b", "--resume_from_checkpoint", "latest"))
    wa, wb = (weights(tmp_path / r / "checkpoint-3-0") for r in "ab")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    ra, rb = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert [r["reward_mean"] for r in ra] == [r["reward_mean"] for r in rb]


def test_params_without_gradient_keep_no_optimizer_state(make_args, tmp_path):
    """Qwen-Image's last block's text-stream output gets no gradient: the saved AdamW state
    lacks it and resuming must accept that (it failed on every Qwen checkpoint)."""
    train_grpo_qwenimage.main(make_args(*FAST, "--max_train_steps", 1, "--output_dir", tmp_path / "q",
                                        module="dancegrpo.train_grpo_qwenimage"))
    saved = optimizer_shards.saved_parameters(str(tmp_path / "q" / "checkpoint-1-0" / "optimizer"))
    assert "transformer_blocks.0.attn.to_add_out.weight" not in saved
    assert "transformer_blocks.0.attn.to_out.0.weight" in saved and "proj_out.weight" in saved


# ------------------------------------------------------------------ 3. never train on NaN
def test_diverging_run_stops_with_exit_3_and_clean_checkpoints(cache_dir, tmp_path, capsys):
    out = tmp_path / "o"
    code = run_main("dancegrpo.train_grpo_flux", "--preset", "tiny", "--cache_dir", cache_dir, "--output_dir", out,
                    "--max_train_steps", 8, "--checkpointing_steps", 1, "--learning_rate", "1e8", *FAST)
    err = capsys.readouterr().err
    assert code == 3, err
    assert "is not finite at step" in err and "--learning_rate" in err
    saved = [p for p in os.listdir(out) if p.startswith("checkpoint")]
    assert len(saved) < 8
    for name in saved:
        assert all(torch.isfinite(t).all() for t in weights(out / name).values())


def test_a_model_file_with_nan_weights_is_called_damaged_not_diverged(make_args, tmp_path):
    """The run never steps on NaN, so NaN weights at a NaN rollout came from the files: the message
    says so instead of advising a lower learning rate."""
    from safetensors.torch import save_file
    model = tmp_path / "model"
    shutil.copytree(make_args().pretrained_model_name_or_path, model, ignore=shutil.ignore_patterns("data"))
    state = load_file(model / "transformer" / WEIGHTS)
    name = sorted(state)[0]
    state[name] = torch.full_like(state[name], float("nan"))
    save_file(state, model / "transformer" / WEIGHTS)
    with pytest.raises(NonFiniteError) as stop:
        train_grpo_flux.main(make_args(*FAST, "--max_train_steps", 1, "--pretrained_model_name_or_path", model))
    message = str(stop.value)
    assert "is not finite at step 1" in message and "damaged" in message and "--pretrained_model_name_or_path" in message
    assert "diverged" not in message and "learning_rate" not in message
    assert not any(p.startswith("checkpoint") for p in os.listdir(make_args().output_dir))


@pytest.mark.parametrize("quantity", ["loss", "grad norm"])
def test_nonfinite_loss_or_grad_norm_stops_before_the_optimizer_step(make_args, tmp_path, monkeypatch, quantity):
    from dancegrpo.algo import grpo
    from dancegrpo import trainer
    from dancegrpo.engines import fsdp
    calls = {"step": 0}
    real_clip, real_update = fsdp.clip_grad_norm, grpo.policy_update

    def clip(model, max_norm):  # NaN at the second step only
        return float("nan") if quantity == "grad norm" and calls["step"] == 2 else real_clip(model, max_norm)

    def update(batch):
        stats = real_update(batch)
        if quantity == "loss" and calls["step"] == 2:
            stats.loss = float("inf")
        return stats

    def counting_step(ctx):
        calls["step"] = ctx.step
        return trainer.train_one_step(ctx, update, grpo.select_train_steps)
    monkeypatch.setattr(fsdp, "clip_grad_norm", clip)
    monkeypatch.setattr(train_grpo_flux, "train_one_step", counting_step)
    args = make_args(*FAST, "--max_train_steps", 3, "--checkpointing_steps", 1)
    with pytest.raises(NonFiniteError, match=f"{quantity}.* is not finite at step 2 .*What to try"):
        train_grpo_flux.main(args)
    assert [r["step"] for r in read_metrics(args.output_dir)] == [1]
    assert sorted(p for p in os.listdir(args.output_dir) if not p.startswith(".")) == \
        ["checkpoint-1-0", "metrics.jsonl", "reward.txt"]


@pytest.mark.parametrize("spec,message", [("jpeg=nan", "not a finite number"), ("jpeg=inf", "not a finite number"),
                                          ("jpeg=0", "Every reward weight")])
def test_reward_weights_are_validated(make_args, capsys, spec, message):
    with pytest.raises(SystemExit) as exc:
        make_args("--reward", spec)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_an_infinite_weighted_reward_stops(make_args, monkeypatch):
    from dancegrpo.rewards import builtin
    monkeypatch.setattr(builtin, "jpeg_kilobytes", lambda im, quality=95: 3e38)
    with pytest.raises(NonFiniteError, match="reward is not finite at step 1"):
        train_grpo_flux.main(make_args(*FAST, "--max_train_steps", 1, "--reward", "jpeg=10"))


# ------------------------------------------------------------------ 4. metrics after a resume
def test_resume_cuts_metrics_back_and_repairs_a_torn_line(make_args, tmp_path):
    out = tmp_path / "out"
    train_grpo_flux.main(make_args(*FAST, "--max_train_steps", 3, "--checkpointing_steps", 2, "--output_dir", out))
    # A crash after step 3's metrics but before its checkpoint, mid-way through writing step 4's line.
    shutil.rmtree(out / "checkpoint-3-0")
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "reward_me')
    with open(out / "reward.txt", "a") as f:
        f.write("-4.1")
    train_grpo_flux.main(make_args(*FAST, "--max_train_steps", 4, "--output_dir", out,
                                   "--resume_from_checkpoint", "latest"))
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert len({r["run_id"] for r in records[:2]}) == 1 and records[2]["run_id"] != records[0]["run_id"]
    assert records[2]["run_id"] == records[3]["run_id"]
    rewards = [float(x) for x in (out / "reward.txt").read_text().split("\n") if x]
    assert rewards == [r["reward_mean"] for r in records]


def test_compare_reads_a_torn_last_line_as_missing_and_flags_nan(tmp_path, capsys):
    from jagg_patch.tools.compare import compare, markdown_table
    for name, rewards in (("ok", [1.0, 2.0, 3.0, 4.0]), ("nan", [1.0, float("nan"), 9.0])):
        (tmp_path / name).mkdir()
        lines = [json.dumps({"step": i + 1, "reward_mean": r, "step_time_s": 1.0, "update_time_s": 0.5})
                 for i, r in enumerate(rewards)]
        (tmp_path / name / "metrics.jsonl").write_text("\n".join(lines) + ("\n" if name == "nan" else '\n{"step": 5, "rew'))
    rows, _ = compare([str(tmp_path / "ok"), str(tmp_path / "nan")], ma_window=1)
    err = capsys.readouterr().err
    assert rows[0]["steps"] == 4 and "torn last line" in err
    assert "different lengths" in err and "too few for a timing claim" in err
    assert rows[1]["nonfinite"] == "reward_mean at steps [2]" and rows[1]["best_ma_reward"] != 9.0
    assert "nan (NON-FINITE)" in markdown_table(rows)


# ------------------------------------------------------------------ 5. resume reproduces or says why not
@pytest.mark.slow
def test_resume_without_seed_uses_the_checkpoints_seed(make_args, tmp_path, capsys):
    train_grpo_flux.main(make_args(*FAST, "--max_train_steps", 2, "--seed", 7, "--output_dir", tmp_path / "a"))
    train_grpo_flux.main(make_args(*FAST, "--max_train_steps", 1, "--seed", 7, "--output_dir", tmp_path / "b"))
    capsys.readouterr()
    train_grpo_flux.main(make_args(*FAST, "--max_train_steps", 2, "--output_dir", tmp_path / "b",
                                   "--resume_from_checkpoint", "latest"))
    assert "using the checkpoint's seed 7" in capsys.readouterr().out
    wa, wb = weights(tmp_path / "a" / "checkpoint-2-0"), weights(tmp_path / "b" / "checkpoint-2-0")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # every step says the run's precision and configuration: the same over the resumed run's segments
    records = read_metrics(tmp_path / "b")
    assert [r["precision"] for r in records] == ["float32"] * 2 and records[0]["run_id"] != records[1]["run_id"]
    assert records[0]["config_id"] == records[1]["config_id"] == read_metrics(tmp_path / "a")[0]["config_id"]


def test_resume_with_changed_flags_lists_them(make_args, tmp_path, capsys):
    out = tmp_path / "out"
    train_grpo_flux.main(make_args(*FAST, "--max_train_steps", 1, "--output_dir", out))
    with pytest.raises(ConfigError, match=r"--learning_rate: 0.01 in the checkpoint, 0.001 now; --sampling_steps: "
                                          r"8 in the checkpoint, 6 now.*--allow_config_change"):
        train_grpo_flux.main(make_args(*FAST, "--max_train_steps", 2, "--output_dir", out, "--learning_rate", 1e-3,
                                       "--sampling_steps", 6, "--resume_from_checkpoint", "latest"))
    assert [r["step"] for r in read_metrics(out)] == [1]
    with pytest.raises(ConfigError) as refused:   # the float32 default is no value a user typed: not 'None'
        train_grpo_flux.main(make_args(*FAST, "--max_train_steps", 2, "--output_dir", out, "--mixed_precision",
                                       "bf16", "--resume_from_checkpoint", "latest"))
    assert "--mixed_precision: not given (its default) in the checkpoint, 'bf16' now" in str(refused.value)
    assert "None" not in str(refused.value)
    train_grpo_flux.main(make_args(*FAST, "--max_train_steps", 2, "--output_dir", out, "--learning_rate", 1e-3,
                                   "--resume_from_checkpoint", "latest", "--allow_config_change"))
    assert "warning: --allow_config_change" in capsys.readouterr().out
    assert [r["step"] for r in read_metrics(out)] == [1, 2]
    # compare reads the folder as one run of two configurations, and says so
    from jagg_patch.tools.compare import compare
    compare([str(out)])
    assert "run 'out' changed its configuration at step(s) [2] (resumed with" in capsys.readouterr().err


def test_latest_skips_weights_only_and_corrupt_checkpoints(make_args, tmp_path, capsys):
    out = tmp_path / "out"
    train_grpo_flux.main(make_args(*FAST, "--max_train_steps", 3, "--checkpointing_steps", 1, "--output_dir", out))
    os.remove(out / "checkpoint-3-0" / "training_state.pt")                 # weights only
    data = (out / "checkpoint-2-0" / WEIGHTS).read_bytes()
    (out / "checkpoint-2-0" / WEIGHTS).write_bytes(data[: len(data) // 2])   # torn by a crash
    os.makedirs(out / "checkpoint-9-0")                                      # empty
    assert ckpt.latest_checkpoint(str(out)) == str(out / "checkpoint-1-0")
    with pytest.raises(ConfigError, match="damaged .*truncated"):  # named explicitly: refused, not skipped
        ckpt.resolve_resume_path(str(out / "checkpoint-2-0"), str(out))
    capsys.readouterr()
    train_grpo_flux.main(make_args(*FAST, "--max_train_steps", 2, "--output_dir", out,
                                   "--resume_from_checkpoint", "latest"))
    printed = capsys.readouterr().out
    assert "skipping" in printed and "checkpoint-3-0" in printed and "weights only" in printed
    assert "checkpoint-2-0" in printed and "truncated" in printed
    assert [r["step"] for r in read_metrics(out)] == [1, 2]
    assert ckpt.checkpoint_problem(str(out / "checkpoint-2-0")) is None  # rewritten whole by the resumed run


# ------------------------------------------------------------------ 6. signals
@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_exits_143(cache_dir, tmp_path):
    out = tmp_path / "o"
    proc = cli("dancegrpo.train_grpo_flux", "--preset", "tiny", "--cache_dir", cache_dir, "--output_dir", out,
               "--max_train_steps", 500, *FAST)
    wait_for_steps(out, 2, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    last = read_metrics(out)[-1]["step"]
    assert f"SIGTERM after step {last}: saved" in err and "Traceback" not in err
    assert ckpt.checkpoint_problem(str(out / f"checkpoint-{last}-0")) is None


@pytest.mark.slow
def test_workers_do_not_outlive_a_killed_launcher(cache_dir, tmp_path):
    """2 ranks with the tiny preset's defaults (batch and GA split over the ranks)."""
    out = tmp_path / "o"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launcher = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                                 "2", "-m", "dancegrpo.train_grpo_flux", "--preset", "tiny", "--cache_dir", cache_dir,
                                 "--output_dir", str(out), "--max_train_steps", "500"],
                                cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for_steps(out, 1, launcher, limit=240)
    workers = [int(p) for p in subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True,
                                              text=True).stdout.split()]
    assert len(workers) == 2
    launcher.kill()
    launcher.wait()
    deadline = time.time() + 90
    while time.time() < deadline and any(_alive(p) for p in workers):
        time.sleep(0.5)
    assert not any(_alive(p) for p in workers), "workers outlived their launcher"
    assert read_metrics(out)[0]["world_size"] == 2 and read_metrics(out)[0]["samples"] == 128
    said = launcher.stderr.read()   # the workers wrote on after the launcher's end (its stderr is theirs)
    assert "stopped: the launcher's end after step" in said and "SIGHUP" not in said, said[-3000:]


@pytest.mark.slow
def test_sigterm_to_the_scripts_launcher_stops_both_ranks_and_exits_143(cache_dir, tmp_path):
    """train_flux.sh's launcher (dancegrpo.launch, torchrun inside) passes SIGTERM on: both ranks
    finish their step and save, and the launcher ends with one line and 143, not a traceback and 1."""
    out, threads = tmp_path / "o", tmp_path / "threads"
    env = exit_threads_env({**os.environ, "OMP_NUM_THREADS": "1", "PRESET": "tiny", "NPROC": "2",
                            "CACHE_DIR": str(cache_dir), "OUTPUT_DIR": str(out)}, threads)
    launcher = subprocess.Popen(["bash", os.path.join(REPO, "train_flux.sh"), "--max_train_steps", "500"], cwd=REPO,
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for_steps(out, 2, launcher, limit=240)
    launcher.send_signal(signal.SIGTERM)   # bash exec'd the launcher: this is its pid
    _, err = launcher.communicate(timeout=180)
    assert launcher.returncode == 128 + signal.SIGTERM, err[-3000:]
    last = read_metrics(out)[-1]["step"]
    assert "launcher: SIGTERM: the workers were stopped" in err and "Traceback" not in err, err[-3000:]
    assert f"SIGTERM after step {last}: saved" in err
    assert ckpt.checkpoint_problem(str(out / f"checkpoint-{last}-0")) is None
    # the ranks left through Interrupted: their process group was released all the same
    assert len(threads_at_exit(threads)) == 3 and gloo_threads_at_exit(threads) == {}


@pytest.mark.slow
def test_a_rank_killed_mid_run_is_named_in_one_line_by_the_launcher(cache_dir, tmp_path):
    """SIGKILL (the OOM killer's signal) to one worker of dancegrpo.launch: the other rank stops with one
    line (its collective lost its peer), the launcher says which rank died of what and how to continue,
    and exits as that rank did (128 + 9); no traceback."""
    out = tmp_path / "o"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launcher = subprocess.Popen([sys.executable, "-m", "dancegrpo.launch", "--standalone", "--nproc_per_node", "2",
                                 "-m", "dancegrpo.train_grpo_flux", "--preset", "tiny", "--cache_dir", cache_dir,
                                 "--output_dir", str(out), "--max_train_steps", "500", "--checkpointing_steps", "1"],
                                cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while ckpt.latest_checkpoint(str(out)) is None:   # a complete checkpoint to continue from
        assert launcher.poll() is None and time.time() < deadline, "no checkpoint written"
        time.sleep(0.1)
    workers = sorted((int(p) for p in subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True,
                                                     text=True).stdout.split()), key=_rank_of)   # [rank 0, rank 1]
    os.kill(workers[1], signal.SIGKILL)
    _, err = launcher.communicate(timeout=180)
    assert launcher.returncode == 128 + signal.SIGKILL, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"launcher: rank 1 (pid {workers[1]}) was killed by SIGKILL") and \
        "--resume_from_checkpoint latest" in last, err[-3000:]
    assert "stopped: rank 0: another rank's process ended" in err and "Traceback" not in err, err[-3000:]


def _rank_of(pid):
    with open(f"/proc/{pid}/environ", "rb") as f:
        return int(dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)[b"RANK"])


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# ------------------------------------------------------------------ 7. early checks
def _no_model_loading(monkeypatch):
    """Fail the test if the transformer, VAE or a reward model is loaded."""
    from dancegrpo import build
    from dancegrpo.models.base import ModelFamily

    def refuse(*a, **kw):
        raise AssertionError("a model was loaded before the input was checked")
    monkeypatch.setattr(ModelFamily, "load", refuse)
    monkeypatch.setattr(build, "WeightedReward", refuse)


def _damage_truncate(path):
    path.write_bytes(path.read_bytes()[:len(path.read_bytes()) // 2])
    return "cannot be read .* truncated or damaged"


def _damage_width(path):
    torch.save(torch.zeros(8, 48), path)   # another text encoder's width: this model's is 32
    return r"holds a \[8, 48\] tensor where this model's encoder_hidden_states is \[T, 32\]"


def _damage_length(path):
    torch.save(torch.zeros(6, 32), path)   # another --max_sequence_length than the other prompts
    return r"encoder_hidden_states files .* differ in shape \(\[8, 32\] in .*\[6, 32\] in"


@pytest.mark.parametrize("damage", [_damage_truncate, _damage_width, _damage_length],
                         ids=["truncated", "width", "length"])
def test_a_damaged_or_reshaped_embedding_file_is_named_before_loading(make_args, tmp_path, monkeypatch, damage):
    """A batch that would draw it crashes steps later with a traceback; found before anything loads."""
    data = tmp_path / "data"
    shutil.copytree(os.path.dirname(make_args().data_json_path), data)
    victim = data / "prompt_embed" / sorted(os.listdir(data / "prompt_embed"))[-1]
    message = damage(victim)
    _no_model_loading(monkeypatch)
    with pytest.raises(ConfigError, match=message) as refused:
        train_grpo_flux.main(make_args("--data_json_path", data / "prompts.json"))
    assert victim.name in str(refused.value) and "preprocessing" in str(refused.value)


@pytest.mark.parametrize("trainer,other", [(train_grpo_flux, train_grpo_qwenimage),
                                           (train_grpo_qwenimage, train_grpo_flux)], ids=["flux", "qwenimage"])
def test_the_other_familys_model_folder_names_its_trainer(make_args, monkeypatch, trainer, other):
    other_model = make_args(module=other.__name__).pretrained_model_name_or_path
    _no_model_loading(monkeypatch)
    with pytest.raises(ConfigError, match=f"holds a {other.FAMILY.transformer_class_name}, not this trainer's "
                                          f"{trainer.FAMILY.transformer_class_name}: train it with "
                                          f"`python -m {other.__name__}`"):
        trainer.main(make_args("--pretrained_model_name_or_path", other_model, module=trainer.__name__))


def test_the_digit_reward_needs_digit_prompts_at_parse_time(make_args, capsys):
    with pytest.raises(SystemExit) as stop:
        make_args("--reward", "digit")   # the tiny preset's prompts are scenes, not digits
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "prompts in" in err and "name no single digit" in err and "--preset digits" in err
    assert make_args("--reward", "digit", preset="digits").reward_terms == [("digit", 1.0)]


def test_a_missing_embedding_file_is_found_before_loading(make_args, tmp_path, monkeypatch):
    data = tmp_path / "data"
    shutil.copytree(os.path.dirname(make_args().data_json_path), data)
    victim = sorted(os.listdir(data / "prompt_embed"))[-1]
    os.remove(data / "prompt_embed" / victim)
    _no_model_loading(monkeypatch)
    with pytest.raises(MissingFileError, match=f"1 embedding file.*{victim}"):
        train_grpo_flux.main(make_args("--data_json_path", data / "prompts.json"))


@pytest.mark.parametrize("content,message", [("", "empty file"), ("[{", "not valid JSON")])
def test_bad_prompt_json_names_the_file(make_args, tmp_path, monkeypatch, content, message):
    bad = tmp_path / "prompts.json"
    bad.write_text(content)
    _no_model_loading(monkeypatch)
    with pytest.raises(ConfigError, match=f"{bad}.*{message}"):
        train_grpo_flux.main(make_args("--data_json_path", bad))


def test_an_unwritable_output_folder_is_found_before_loading(make_args, tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    _no_model_loading(monkeypatch)
    with pytest.raises(ConfigError, match="is not writable"):
        train_grpo_flux.main(make_args("--output_dir", tmp_path / "file" / "out"))


@pytest.mark.parametrize("damage", ["config", "weights"])
def test_broken_model_files_give_one_message(cache_dir, tmp_path, make_args, capsys, damage):
    model = tmp_path / "model"
    shutil.copytree(make_args().pretrained_model_name_or_path, model, ignore=shutil.ignore_patterns("data"))
    target = model / "transformer" / ("config.json" if damage == "config" else WEIGHTS)
    target.write_bytes(target.read_bytes()[:40])
    assert run_main("dancegrpo.train_grpo_flux", "--preset", "tiny", "--cache_dir", cache_dir, "--output_dir",
                    tmp_path / "o", "--pretrained_model_name_or_path", model) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(target) in err and "download the weights again" in err


@pytest.mark.parametrize("value", ["-1e-3", "0", "-2"])
def test_non_positive_learning_rate_is_rejected(make_args, capsys, value):
    with pytest.raises(SystemExit):
        make_args("--learning_rate", value)
    assert f"--learning_rate must be a positive number, got {float(value)}" in capsys.readouterr().err


def test_a_flag_error_is_short(cache_dir):
    proc = cli("dancegrpo.train_grpo_qwenimage", "--preset", "tiny", "--cache_dir", cache_dir, "--bogus")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and err.count("\n") == 2
    assert "unrecognized arguments: --bogus" in err and "--help" in err


def test_tiny_preset_splits_its_batch_over_ranks():
    from dancegrpo.presets import preset_spec, spec_defaults_for_world
    spec = preset_spec("flux", "tiny")
    one = spec_defaults_for_world(spec["defaults"], spec["num_prompts"], 1)
    two = spec_defaults_for_world(spec["defaults"], spec["num_prompts"], 2)
    assert two["train_batch_size"] * 2 == one["train_batch_size"] <= spec["num_prompts"]
    assert two["gradient_accumulation_steps"] * 2 == one["gradient_accumulation_steps"]


@pytest.mark.parametrize("given", [(), ("--gradient_accumulation_steps", "32")])
def test_a_world_size_the_tiny_preset_cannot_split_is_refused_before_it_builds(given, tmp_path, monkeypatch, capsys):
    """3 ranks: 8 prompts do not split (the floor would train 6 of them, GA 128 // 3 is no count of
    samples); said in one line naming the world sizes that do, whatever else is given."""
    from dancegrpo import presets
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setattr(presets, "materialize_preset", lambda *a: pytest.fail("built the preset before refusing"))
    with pytest.raises(SystemExit) as stop:
        train_grpo_flux.parse_args(train_grpo_flux.build_parser(), ["--preset", "tiny", "--cache_dir", str(tmp_path),
                                                                    "--output_dir", str(tmp_path / "o"), *given])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "which 3 ranks cannot split evenly: launch 1, 2, 4 or 8 ranks" in err, err
    assert "--gradient_accumulation_steps 42" not in err


def test_the_tiny_preset_on_3_ranks_trains_the_batch_given_by_hand(cache_dir, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    args = train_grpo_flux.parse_args(train_grpo_flux.build_parser(),
                                      ["--preset", "tiny", "--cache_dir", cache_dir, "--output_dir", "/tmp/unused",
                                       "--train_batch_size", "1", "--gradient_accumulation_steps", "16"])
    assert (args.train_batch_size, args.gradient_accumulation_steps) == (1, 16)


# ------------------------------------------------------------------ 8. disk
@pytest.mark.slow
def test_checkpoints_total_limit_keeps_the_newest(make_args, tmp_path, monkeypatch):
    out = tmp_path / "out"
    train_grpo_flux.main(make_args(*FAST, "--max_train_steps", 4, "--checkpointing_steps", 1,
                                   "--checkpoints_total_limit", 2, "--output_dir", out))
    assert sorted(p for p in os.listdir(out) if p.startswith("checkpoint")) == ["checkpoint-3-0", "checkpoint-4-0"]
    # A resumed run keeps the checkpoint it resumed from until it has written a whole one of its own, then
    # counts it like any other: a limit of 1 ends on one checkpoint, and a restart gains every step.
    kept = []
    real_save = ckpt.save_checkpoint
    monkeypatch.setattr(ckpt, "save_checkpoint", lambda out_dir, *a, **kw: (
        kept.append(sorted(p for p in os.listdir(out_dir) if p.startswith("checkpoint-"))),
        real_save(out_dir, *a, **kw))[1])
    train_grpo_flux.main(make_args(*FAST, "--max_train_steps", 6, "--checkpointing_steps", 1,
                                   "--checkpoints_total_limit", 1, "--output_dir", out,
                                   "--resume_from_checkpoint", out / "checkpoint-3-0"))
    assert sorted(p for p in os.listdir(out) if p.startswith("checkpoint")) == ["checkpoint-6-0"]
    # what the folder held as each checkpoint was written (after the retention before the write)
    assert kept == [["checkpoint-3-0", "checkpoint-4-0"], ["checkpoint-4-0"], ["checkpoint-5-0"]]


def test_a_full_disk_keeps_the_previous_checkpoint(make_args, tmp_path, monkeypatch):
    out = tmp_path / "out"
    real_save = torch.save

    def save(obj, path, *a, **kw):
        if "checkpoint-2-0" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, path, *a, **kw)
    monkeypatch.setattr(ckpt.torch, "save", save)
    with pytest.raises(DiskFullError, match="no space left.*checkpoint-1-0' is intact.*--checkpoints_total_limit"):
        train_grpo_flux.main(make_args(*FAST, "--max_train_steps", 3, "--checkpointing_steps", 1,
                                       "--output_dir", out))
    assert sorted(p for p in os.listdir(out) if p.startswith("checkpoint")) == ["checkpoint-1-0"]
    assert ckpt.checkpoint_problem(str(out / "checkpoint-1-0")) is None


@pytest.mark.parametrize("what", ["metrics line", "sample grid"])
@pytest.mark.slow
def test_a_full_disk_under_the_metrics_or_a_grid_keeps_the_step_in_a_checkpoint(make_args, tmp_path, monkeypatch,
                                                                                 capsys, what):
    """ENOSPC while writing step 2's metrics line (half of it written) or its sample grid: exit 3 with the
    full-disk message, step 2 kept in checkpoint-2-0, nothing written before lost, no partial file left;
    the run resumes from there and ends as the unbroken one."""
    from dancegrpo import samples
    from dancegrpo.utils import metrics as metrics_module
    out = tmp_path / "out"
    argv = [*FAST, "--max_train_steps", 3, "--checkpointing_steps", 3, "--sample_every", 1]
    train_grpo_flux.main(make_args(*argv, "--output_dir", tmp_path / "unbroken"))
    real_json, real_tile = metrics_module.json.dumps, samples.tile

    def full(text):
        raise OSError(errno.ENOSPC, "No space left on device")

    if what == "metrics line":
        def dumps(record, *a, **kw):   # writes half the line, then the disk is full
            line = real_json(record, *a, **kw)
            return line if record.get("step") != 2 else line[:len(line) // 2] + full("")
        monkeypatch.setattr(metrics_module.json, "dumps", dumps)
    else:
        class FullImage:
            def __init__(self, image):
                self.image = image

            def save(self, path):   # half a file, then the disk is full
                with open(path, "wb") as f:
                    f.write(b"\x89PNG half")
                full("")

        def tile(images, columns):
            image = real_tile(images, columns)
            return FullImage(image) if len(os.listdir(out / "samples")) == 2 else image
        monkeypatch.setattr(samples, "tile", tile)
    capsys.readouterr()
    with pytest.raises(DiskFullError) as stop:
        train_grpo_flux.main(make_args(*argv, "--output_dir", out))
    message = str(stop.value)
    assert f"no space left to write step 2's {what}" in message and "checkpoint-2-0" in message
    assert "--resume_from_checkpoint latest" in message and ckpt.checkpoint_problem(str(out / "checkpoint-2-0")) is None
    assert sorted(os.listdir(out / "samples")) == ["step-000000.png", "step-000001.png"]   # no partial file
    monkeypatch.undo()
    train_grpo_flux.main(make_args(*argv, "--output_dir", out, "--resume_from_checkpoint", "latest"))
    a, b = weights(tmp_path / "unbroken" / "checkpoint-3-0"), weights(out / "checkpoint-3-0")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [r["step"] for r in read_metrics(out)] == ([1, 3] if what == "metrics line" else [1, 2, 3])


@pytest.fixture
def small_disk(tmp_path):
    """A real 5 MB file system (tmpfs): room for three tiny-preset checkpoints (1.39 MB each), not four."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=5m", "tmpfs", str(disk)], capture_output=True,
                             text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here (needs root and mount rights): {mounted.stderr.strip()}")
    yield disk
    subprocess.run(["umount", str(disk)], check=True)


@pytest.mark.slow
def test_a_real_full_disk_stops_with_the_message_and_the_limit_makes_room(small_disk, cache_dir, capsys):
    """The disk fills while DCP writes the optimizer shard (its CheckpointException is a
    BaseException): exit 3 with the message, no .tmp left, the earlier checkpoints whole. The advice
    works: --checkpoints_total_limit 1 deletes the older checkpoints BEFORE the next write, sparing the
    one resumed from only until a newer one is whole, so the resumed run ends on a disk that holds three,
    with one checkpoint, and a second restart needs no more room."""
    out = small_disk / "out"
    run = ["dancegrpo.train_grpo_flux", "--preset", "tiny", "--cache_dir", cache_dir, *FAST, "--max_train_steps", 6,
           "--checkpointing_steps", 1, "--output_dir", out]
    status = run_main(*run)
    err = capsys.readouterr().err
    assert status == 3, err[-2000:]
    assert "no space left to write checkpoint-4-0" in err and "checkpoint-3-0' is intact" in err
    assert "Traceback" not in err
    assert sorted(os.listdir(out)) == [".run.lock", "checkpoint-1-0", "checkpoint-2-0", "checkpoint-3-0",
                                       "metrics.jsonl", "reward.txt"]   # no .tmp folder left
    assert all(ckpt.checkpoint_problem(str(out / f"checkpoint-{n}-0")) is None for n in (1, 2, 3))
    status = run_main(*run, "--checkpoints_total_limit", 1, "--resume_from_checkpoint", "latest",
                      "--allow_config_change")
    assert status == 0, capsys.readouterr().err[-2000:]
    assert sorted(p for p in os.listdir(out) if p.startswith("checkpoint")) == ["checkpoint-6-0"]


@pytest.mark.slow
def test_a_limit_of_one_resumes_again_and_again_on_a_disk_that_holds_two(small_disk, cache_dir, capsys):
    """The advice's promise: --checkpoints_total_limit 1 needs room for two checkpoints, resumed or not
    (the one resumed from goes once a newer one is whole); each restart trains to its end."""
    out = small_disk / "out"
    subprocess.run(["mount", "-o", "remount,size=3600k", str(small_disk)], check=True)   # two fit, not three
    for steps in (3, 6, 9):
        status = run_main("dancegrpo.train_grpo_flux", "--preset", "tiny", "--cache_dir", cache_dir, *FAST,
                          "--max_train_steps", steps, "--checkpointing_steps", 1, "--output_dir", out,
                          "--checkpoints_total_limit", 1, *(["--resume_from_checkpoint", "latest"] if steps > 3 else []))
        assert status == 0, capsys.readouterr().err[-2000:]
        assert sorted(p for p in os.listdir(out) if p.startswith("checkpoint")) == [f"checkpoint-{steps}-0"]


def test_checkpoint_files_follow_the_umask(make_args, tmp_path):
    old = os.umask(0o022)
    try:
        train_grpo_flux.main(make_args(*FAST, "--max_train_steps", 1, "--output_dir", tmp_path / "out"))
    finally:
        os.umask(old)
    folder = tmp_path / "out" / "checkpoint-1-0"
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            assert os.stat(os.path.join(root, name)).st_mode & 0o777 == 0o755, name
        for name in files:
            assert os.stat(os.path.join(root, name)).st_mode & 0o777 == 0o644, name
    assert os.listdir(folder / "optimizer")  # the shards are among the files checked


def test_a_stop_is_said_before_the_signal_handlers_are_given_back(make_args, monkeypatch, capsys):
    """When one rank ends, torchrun sends SIGTERM to the others; a rank unwinding its own stop (a lost
    peer, NaN, a full disk) after StopRequest.uninstall is killed by it without a word (seen: the killed-
    rank test lost rank 0's line now and then). So the stop's line is out before the handlers go, and
    said once."""
    from dancegrpo import trainer
    from dancegrpo.errors import exit_on_config_error
    from dancegrpo.run.signals import StopRequest
    said_before_uninstall = []
    real_uninstall = StopRequest.uninstall

    def uninstall(self):
        said_before_uninstall.append(capsys.readouterr().err)
        real_uninstall(self)

    def halted(*args, **kwargs):
        raise NonFiniteError("loss is nan at step 3")
    monkeypatch.setattr(StopRequest, "uninstall", uninstall)
    monkeypatch.setattr(trainer, "_train", halted)
    with pytest.raises(SystemExit) as stop:
        exit_on_config_error(train_grpo_flux.main)(make_args(*FAST, "--max_train_steps", 1))
    assert stop.value.code == 3
    assert said_before_uninstall == ["stopped: loss is nan at step 3\n"]
    assert "stopped:" not in capsys.readouterr().err   # not said a second time
