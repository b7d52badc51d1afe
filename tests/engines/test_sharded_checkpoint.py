"""Checkpoints that scale: the optimizer state is written per rank (torch.distributed.checkpoint),
the transformer folder stays a full drop-in model, and a killed 2-rank run resumes to the weights
of the unbroken one. The runs go through JAGG with --jagg_frac auto measured at step 1 only, so a
resume must also restore the routing that step chose (kept in the checkpoint)."""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from dancegrpo.utils import checkpoint as ckpt
from dancegrpo import train_grpo_flux
from dancegrpo.trainer import setup

from helpers import FAST, REPO_ROOT, exit_threads_env, gloo_threads_at_exit, read_metrics, run_main, threads_at_exit

REPO = REPO_ROOT
WEIGHTS = "diffusion_pytorch_model.safetensors"


AUTO = ["--jagg_window", "3", "--jagg_frac", "auto", "--jagg_monitor_every", "100"]


def _launch(cache_dir, out, *flags, exit_threads=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env = exit_threads_env(env, exit_threads) if exit_threads else env
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             "-m", "jagg_patch", "dancegrpo.train_grpo_flux", "--preset", "tiny", "--cache_dir",
                             cache_dir, "--output_dir", str(out), "--checkpointing_steps", "1", *AUTO,
                             *map(str, flags)],
                            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _finish(proc, limit=300):
    _, err = proc.communicate(timeout=limit)
    assert proc.returncode == 0, err[-3000:]


@pytest.mark.slow
def test_two_ranks_save_shards_and_a_killed_run_resumes_exactly(cache_dir, tmp_path, capsys):
    a, b, threads = tmp_path / "a", tmp_path / "b", tmp_path / "threads"
    _finish(_launch(cache_dir, a, "--max_train_steps", 3, exit_threads=threads))

    # The same run, killed (SIGKILL to every process) once its first checkpoint is complete.
    proc = _launch(cache_dir, b, "--max_train_steps", 3)
    deadline = time.time() + 240
    while not (b / "checkpoint-1-0" / ckpt.MANIFEST_NAME).is_file():
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read()[-3000:] if proc.poll() else "slow"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    resumed_from = ckpt.latest_checkpoint(str(b))
    assert resumed_from is not None and not resumed_from.endswith("checkpoint-3-0")
    _finish(_launch(cache_dir, b, "--max_train_steps", 3, "--resume_from_checkpoint", "latest", exit_threads=threads))
    # Each run's process group was released before its ranks exited (torchrun's own process has none):
    # no gloo thread was left running into interpreter teardown, where the process can abort (-6).
    assert len(threads_at_exit(threads)) == 6 and gloo_threads_at_exit(threads) == {}

    wa, wb = (load_file(str(r / "checkpoint-3-0" / WEIGHTS)) for r in (a, b))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    routed = [[record["jagg_routed"] for record in read_metrics(r)] for r in (a, b)]
    assert routed[0] == routed[1] and routed[0][-1] > 0   # step 1's routing, restored on resume

    # One optimizer file per rank, each holding about half of the AdamW moments (DCP's metadata
    # says which file holds which chunk of which tensor).
    shards = b / "checkpoint-3-0" / "optimizer"
    assert all((shards / f"__{r}_0.distcp").is_file() for r in (0, 1))
    per_file = _moment_elements_per_file(shards)
    total = 2 * sum(t.numel() for t in wa.values())  # exp_avg + exp_avg_sq
    assert sorted(per_file) == ["__0_0.distcp", "__1_0.distcp"] and sum(per_file.values()) == total
    assert all(0.4 * total < n < 0.6 * total for n in per_file.values()), (per_file, total)
    # The transformer folder is the full model (every parameter, full shape), loadable by diffusers.
    from diffusers import FluxTransformer2DModel
    model = FluxTransformer2DModel.from_pretrained(str(b / "checkpoint-3-0"))
    assert sum(p.numel() for p in model.parameters()) == sum(t.numel() for t in wa.values())
    _resume_on_one_rank(cache_dir, b, capsys)


def _resume_on_one_rank(cache_dir, out, capsys):
    """The 2-rank run resumed in one process: refused naming the rank counts first (the per-rank flags a
    preset splits over the ranks differ only because of them); with --allow_config_change it continues
    from the 2-rank optimizer shards."""
    run = ["jagg_patch", "dancegrpo.train_grpo_flux", "--preset", "tiny", "--cache_dir", cache_dir, "--output_dir",
           out, "--max_train_steps", 4, "--checkpointing_steps", 1, *AUTO, "--resume_from_checkpoint", "latest"]
    capsys.readouterr()
    assert run_main(*run) == 2
    err = capsys.readouterr().err
    assert "written by 2 rank(s), on 1 (so do per-rank flags: --gradient_accumulation_steps" in err, err[-2000:]
    assert "torchrun --nproc_per_node 2" in err
    assert run_main(*run, "--allow_config_change") == 0
    assert "written by 2 rank(s), on 1" in capsys.readouterr().out
    assert ckpt.checkpoint_problem(str(out / "checkpoint-4-0")) is None


def _moment_elements_per_file(folder):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import MetadataIndex
    md = FileSystemReader(str(folder)).read_metadata()
    counts = {}
    for key, meta in md.state_dict_metadata.items():
        if key.endswith((".exp_avg", ".exp_avg_sq")):
            for chunk in meta.chunks:
                where = md.storage_data[MetadataIndex(key, chunk.offsets)].relative_path
                counts[where] = counts.get(where, 0) + chunk.sizes.numel()
    return counts


def test_checkpoints_of_the_single_file_format_still_resume(make_args, tmp_path):
    """Checkpoints written before the optimizer was sharded hold it whole in training_state.pt."""
    out = tmp_path / "out"
    train_grpo_flux.main(make_args(*FAST, "--max_train_steps", 3, "--output_dir", tmp_path / "ref"))
    train_grpo_flux.main(make_args(*FAST, "--max_train_steps", 2, "--output_dir", out))
    folder = out / "checkpoint-2-0"
    ctx = setup(make_args(*FAST, "--max_train_steps", 2, "--output_dir", out, "--resume_from_checkpoint", folder),
                train_grpo_flux.FAMILY(make_args(*FAST)), plan=None)
    full = get_optimizer_state_dict(ctx.transformer, ctx.optimizer, options=StateDictOptions(full_state_dict=True))
    state = torch.load(folder / ckpt.STATE_NAME, weights_only=False)
    torch.save({**state, "optimizer": full}, folder / ckpt.STATE_NAME)
    import shutil
    shutil.rmtree(folder / ckpt.OPTIMIZER_DIR)
    os.remove(folder / ckpt.MANIFEST_NAME)  # the old format's manifest did not list the shards
    assert ckpt.checkpoint_problem(str(folder)) is None
    train_grpo_flux.main(make_args(*FAST, "--max_train_steps", 3, "--output_dir", out,
                                   "--resume_from_checkpoint", "latest"))
    wa, wb = (load_file(str(r / "checkpoint-3-0" / WEIGHTS)) for r in (tmp_path / "ref", out))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
