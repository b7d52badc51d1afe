"""The output folder belongs to one run at a time.

`claim_output_dir` runs on rank 0 before any model is loaded. It
- takes an exclusive lock (`.run.lock`, flock: the kernel drops it when the process dies, so a
  lock left by a killed run is stale and is taken over with a notice);
- refuses a folder that already holds a run's files unless the run resumes or the user chose
  `--overwrite_output_dir` (two runs appending to one metrics.jsonl and overwriting each
  other's checkpoints is silent data loss);
- proves the folder writable, and removes half-written checkpoint folders of a dead run;
- never deletes checkpoints a reader (dancegrpo.evaluate) holds: see dancegrpo.run.readers.
"""
import datetime
import fcntl
import glob
import json
import os
import shutil
import socket

from ..errors import ConfigError
from .readers import exclusive

LOCK_NAME = ".run.lock"
RUN_FILES = ("metrics.jsonl", "reward.txt", "reward_curve.png", "samples")
CHECKPOINT_GLOB = "checkpoint-*-*"


class RunLock:
    """An flock on <output_dir>/.run.lock holding {pid, host, started, run_id}."""

    def __init__(self, output_dir, run_id):
        self.path = os.path.join(output_dir, LOCK_NAME)
        self.run_id = run_id
        self._fd = None
        self.previous = None  # the holder a stale lock named, if any

    def acquire(self):
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise ConfigError(
                f"--output_dir {os.path.dirname(self.path)!r} is in use by another run ({_who(holder)}). "
                "Wait for it to finish, stop it, or choose another --output_dir.") from None
        self.previous = _read_holder(fd) or None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "run_id": self.run_id,
                                 "started": datetime.datetime.now().isoformat(timespec="seconds")}).encode())
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self):
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)
        finally:
            os.close(self._fd)  # closing drops the flock
            self._fd = None


def _read_holder(fd):
    os.lseek(fd, 0, os.SEEK_SET)
    try:
        return json.loads(os.read(fd, 4096).decode() or "{}")
    except (ValueError, UnicodeDecodeError):
        return {}


def _who(holder):
    if not holder:
        return "holder unknown"
    return f"pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}"


def previous_run_files(output_dir):
    """The files and checkpoint folders a previous run left in output_dir."""
    found = [os.path.join(output_dir, n) for n in RUN_FILES if os.path.exists(os.path.join(output_dir, n))]
    return found + sorted(p for p in glob.glob(os.path.join(output_dir, CHECKPOINT_GLOB)) if os.path.isdir(p))


def check_writable(output_dir, flag="--output_dir"):
    try:
        os.makedirs(output_dir, exist_ok=True)
        probe = os.path.join(output_dir, f".write-test-{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"{flag} {output_dir!r} is not writable ({e.strerror}); choose a folder you can "
                          "write to.") from None


def claim_output_dir(output_dir, run_id, resuming, overwrite, log=print):
    """Lock the folder for this run and make sure no earlier run's files are lost. Returns the lock."""
    check_writable(output_dir)
    lock = RunLock(output_dir, run_id).acquire()
    try:
        if lock.previous:
            log(f"notice: took over a stale lock on {output_dir!r} left by a run that is gone "
                f"({_who(lock.previous)})")
        for tmp in glob.glob(os.path.join(output_dir, CHECKPOINT_GLOB + ".tmp")) + \
                glob.glob(os.path.join(output_dir, CHECKPOINT_GLOB + ".old")):
            shutil.rmtree(tmp, ignore_errors=True)  # half-written by a run that died while saving
        previous = previous_run_files(output_dir)
        if previous and resuming and overwrite:
            log(f"notice: --overwrite_output_dir is ignored: the run resumes, so the files in {output_dir!r} are "
                "kept (to start afresh, drop --resume_from_checkpoint)")
        if previous and not resuming:
            if not overwrite:
                raise ConfigError(
                    f"--output_dir {output_dir!r} already holds a run ({', '.join(map(os.path.basename, previous[:4]))}"
                    f"{' ...' if len(previous) > 4 else ''}). Continue it with --resume_from_checkpoint latest, "
                    "replace it with --overwrite_output_dir, or choose another --output_dir.")
            with exclusive(output_dir) as readers:
                if readers:
                    raise ConfigError(f"--overwrite_output_dir would delete the checkpoints in {output_dir!r} while "
                                      f"{'; '.join(readers)} reads them. Wait for it to finish or stop it, or choose "
                                      "another --output_dir.")
                for path in previous:
                    shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
            log(f"notice: --overwrite_output_dir removed the previous run's {len(previous)} files and checkpoints "
                f"from {output_dir!r}")
    except BaseException:
        lock.release()
        raise
    return lock
