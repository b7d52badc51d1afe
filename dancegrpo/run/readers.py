"""Readers of a run folder. `dancegrpo.evaluate` holds a shared lock on <run folder>/.readers.lock
while it reads checkpoints there (and says who it is in .readers/); a run that would delete
checkpoints in the folder (--overwrite_output_dir, --checkpoints_total_limit) first takes the lock
exclusively, so it never deletes what a reader is loading: it refuses at start, or puts the pruning
off to a later save, naming the readers. flock: the kernel drops a dead reader's lock."""
import contextlib
import datetime
import fcntl
import json
import os
import re
import shutil
import socket
import uuid

LOCK_NAME = ".readers.lock"
REGISTRY = ".readers"
_CHECKPOINT = re.compile(r"checkpoint-\d+-\d+")


def run_folder_of(path):
    """The run folder a checkpoint path lies in (checkpoint-STEP-EPOCH[/ema|/merged]), else None."""
    path = os.path.abspath(path)
    for folder in (path, os.path.dirname(path)):
        if _CHECKPOINT.fullmatch(os.path.basename(folder)):
            return os.path.dirname(folder)
    return None


class ReaderLock:
    """A shared lock on a run folder, held while reading its checkpoints."""

    def __init__(self, folder, what=None):
        self.folder = folder
        self.what = what or "a reader"
        self._fd = self._entry = None

    def acquire(self):
        self._fd = os.open(os.path.join(self.folder, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self._fd, fcntl.LOCK_SH)   # blocks only while a run deletes (a moment)
        os.makedirs(os.path.join(self.folder, REGISTRY), exist_ok=True)
        self._entry = os.path.join(self.folder, REGISTRY, f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}")
        with open(self._entry, "w") as f:
            json.dump({"pid": os.getpid(), "host": socket.gethostname(), "what": self.what,
                       "started": datetime.datetime.now().isoformat(timespec="seconds")}, f)
        return self

    def release(self):
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.remove(self._entry)
        os.close(self._fd)   # closing drops the flock
        self._fd = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


def _alive_here(entry):
    if entry.get("host") != socket.gethostname():
        return True   # another machine's process cannot be checked from here
    try:
        os.kill(int(entry["pid"]), 0)
    except (OSError, ValueError, KeyError):
        return False
    return True


def describe_readers(folder):
    """One phrase per registered reader that may still be alive."""
    found = []
    registry = os.path.join(folder, REGISTRY)
    for name in sorted(os.listdir(registry)) if os.path.isdir(registry) else []:
        try:
            with open(os.path.join(registry, name)) as f:
                entry = json.load(f)
        except (OSError, ValueError):
            continue
        if _alive_here(entry):
            found.append(f"{entry.get('what')} (pid {entry.get('pid')} on {entry.get('host')}, since "
                         f"{entry.get('started')})")
    return found or ["a reader that did not say who it is"]


@contextlib.contextmanager
def exclusive(folder):
    """Held while deleting checkpoints in `folder`: yields [] with the folder locked against readers,
    or the readers' descriptions when one holds it (nothing is then locked: do not delete)."""
    fd = os.open(os.path.join(folder, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield describe_readers(folder)
            return
        # No reader holds the folder: entries left in the registry are of readers that died.
        shutil.rmtree(os.path.join(folder, REGISTRY), ignore_errors=True)
        yield []
    finally:
        os.close(fd)
