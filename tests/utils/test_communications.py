"""The process group is released before a process exits, however it exits: a two-rank run (plain
processes with torchrun's environment, no torchrun to stop them first) whose ranks stop with an error
(a diverging run: exit 3) leaves no gloo thread running at the very end of its exit. Left running
into interpreter teardown, such a thread now and then aborts the process ("terminate called without
an active exception", exit -6). The normal end and the signal's end: tests/engines/test_sharded_checkpoint.py
and tests/run/test_reliability.py."""
import os
import socket
import subprocess
import sys

import pytest

from helpers import FAST, REPO_ROOT, exit_threads_env, gloo_threads_at_exit, threads_at_exit


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_ranks_that_stop_with_an_error_release_their_process_group(cache_dir, tmp_path):
    threads, out = tmp_path / "threads", tmp_path / "out"
    base = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(_free_port()), "PYTHONPATH": REPO_ROOT}
    argv = [sys.executable, "-m", "dancegrpo.train_grpo_flux", "--preset", "tiny", "--cache_dir", cache_dir,
            "--output_dir", str(out), *map(str, FAST), "--learning_rate", "1e8", "--max_train_steps", "8"]
    ranks = [subprocess.Popen(argv, cwd=str(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              env=exit_threads_env({**base, "RANK": str(r), "LOCAL_RANK": str(r)}, threads))
             for r in range(2)]
    errors = [p.communicate(timeout=300)[1] for p in ranks]
    assert [p.returncode for p in ranks] == [3, 3], [e[-2000:] for e in errors]
    assert all("is not finite at step" in e and "terminate called" not in e for e in errors)
    assert sorted(threads_at_exit(threads)) == sorted(p.pid for p in ranks)
    assert gloo_threads_at_exit(threads) == {}
