"""jagg_metrics.jsonl: the upstream adapter's one line per step in <output_dir> (the restated step's,
and the file's own step's when it runs as it is), or one line per flush of the deferred proxy where a
script's loop is inline in its main(); written on rank 0; a full disk stops every rank alike."""
import json
import os

from dancegrpo.errors import DiskFullError, is_disk_full
from dancegrpo.utils.communications import all_reduce_max, world_size
from dancegrpo.utils.launch import launch_rank
from dancegrpo.utils.metrics import append_line, drop_torn_tail

METRICS_FILE = "jagg_metrics.jsonl"


def _write_metrics_line(output_dir, record, first):
    """One line appended (lines of other runs in the folder are kept, told apart by run_id), a torn
    line left by an earlier run dropped first. Returns the OSError of a full disk (the line then not
    written at all), else None."""
    if not output_dir or launch_rank() != 0:
        return None
    path = os.path.join(output_dir, METRICS_FILE)
    try:
        os.makedirs(output_dir, exist_ok=True)
        if first:
            drop_torn_tail(path)
        append_line(path, json.dumps(record))
    except OSError as e:
        if not is_disk_full(e):
            raise
        return e
    return None


def _stop_if_disk_full(error, output_dir, step, device):
    """Every rank agrees whether rank 0 found the disk full (so none waits in a collective for a rank
    that stopped), then all stop with DiskFullError (exit 3)."""
    if not all_reduce_max(float(error is not None), device):
        return
    why = getattr(error, "strerror", None) or "No space left on device"
    raise DiskFullError(f"no space left to write step {step}'s line of {METRICS_FILE} in {output_dir!r} "
                        f"({why}); the file keeps the steps before it, nothing half-written; upstream's "
                        "checkpoints written so far are untouched. Free space, then start the run again")


def write_step_line(args, record, step, device):
    """Step `step`'s record into args.output_dir's jagg_metrics.jsonl (none without an output_dir)."""
    output_dir = getattr(args, "output_dir", None)
    _stop_if_disk_full(_write_metrics_line(output_dir, record, first=step == 1), output_dir, step, device)


class FlushLines:
    """A proxy's on_flush callback for a script whose update loop is inline in its main() (no
    train_one_step to wrap): each flush's counts, `record_of(stats, device)` (summed over the ranks:
    jagg_patch.deferred.stats.flush_record) and the number of ranks, as one line of
    <folder>/jagg_metrics.jsonl, on rank 0. The folder is the one given, else the one the script names
    to accelerate (its ProjectConfiguration's project_dir), else the working folder; it is decided at
    the script's first prepare (`place`) and said once. `records` keeps every line, for the run's summary."""

    def __init__(self, folder, file_name, config, record_of):
        import uuid
        self.folder, self.file_name, self.config, self.record_of = folder, file_name, config, record_of
        self.run_id, self.records = uuid.uuid4().hex[:12], []

    def place(self, accelerator, say=print):
        """The folder, once: given, else the accelerator's project_dir, else the working folder (checked
        writable: a DeferredError line otherwise); its file's path said on rank 0."""
        if getattr(self, "_placed", False):
            return
        from dancegrpo.errors import ConfigError
        from dancegrpo.run.rundir import check_writable
        from .deferred.errors import DeferredError
        named = None if self.folder else getattr(accelerator, "project_dir", None)
        folder = self.folder or named or "."
        try:
            check_writable(folder, flag="--jagg_metrics_dir" if self.folder else "the metrics folder")
        except ConfigError as e:
            raise DeferredError(str(e)) from None
        self.folder, self._placed = folder, True
        whose = " (the script's accelerate project_dir; --jagg_metrics_dir DIR to choose)" if named else ""
        if launch_rank() == 0:
            say(f"jagg_patch.deferred: one line per flush in {os.path.abspath(self.path)}{whose}")

    @property
    def path(self):
        return os.path.join(self.folder or ".", METRICS_FILE)

    def __call__(self, proxy, stats):
        if self.folder is None:
            self.folder = "."
        count = len(self.records) + 1
        record = {"flush": count, "run_id": self.run_id, "file": self.file_name, "update": "deferred",
                  **self.config.as_dict(), **self.record_of([stats], proxy.device), "world_size": world_size()}
        self.records.append(record)
        _stop_if_disk_full(_write_metrics_line(self.folder, record, first=count == 1), self.folder, count,
                           proxy.device)
