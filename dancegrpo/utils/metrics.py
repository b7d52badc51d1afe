"""Counting transformer passes by hooks, and the per-step metrics files."""
import contextlib
import json
import os

import torch


def first_tensor(output):
    if torch.is_tensor(output):
        return output
    if isinstance(output, (tuple, list)) and output and torch.is_tensor(output[0]):
        return output[0]
    sample = getattr(output, "sample", None)
    return sample if torch.is_tensor(sample) else None


class PassCounter:
    """Counts per-sample transformer passes with hooks on the model itself.

    A forward of a batch of m samples counts m. `backwards` counts the forward
    instances whose output received a gradient, i.e. whose graph was
    backpropagated (a JAGG group counts 2 per sample, its two endpoints).
    rows_per_sample: the batch rows one sample takes in a call (2 where a classifier-free-guided
    call stacks each sample's conditional and unconditional rows); such a call counts once per sample.
    """

    def __init__(self, module, rows_per_sample=1):
        self.reset()
        self._apart = False
        self._rows = rows_per_sample
        self._handle = module.register_forward_hook(self._on_forward)

    def _on_forward(self, module, inputs, output):
        out = first_tensor(output)
        n = max(1, out.shape[0] // self._rows) if out is not None and out.ndim > 0 else 1
        if self._apart:
            self.monitor_forwards += n
            if torch.is_grad_enabled() and out is not None and out.requires_grad:
                out.register_hook(lambda grad, n=n: self._on_monitor_backward(n))
        elif torch.is_grad_enabled() and out is not None and out.requires_grad:
            self.forwards_grad += n
            out.register_hook(lambda grad, n=n: self._on_backward(n))
        else:
            self.forwards_nograd += n

    def _on_backward(self, n):
        self.backwards += n

    def _on_monitor_backward(self, n):
        self.monitor_backwards += n

    @contextlib.contextmanager
    def apart(self):
        """The passes inside are a measurement's (e.g. jagg_patch's monitor), counted apart from the
        update's, so the update's counts are those of the same run without it."""
        self._apart = True
        try:
            yield
        finally:
            self._apart = False

    def reset(self):
        self.forwards_grad = self.forwards_nograd = self.backwards = 0
        self.monitor_forwards = self.monitor_backwards = 0

    def as_dict(self):
        counts = {"transformer_forwards_grad": self.forwards_grad,
                  "transformer_forwards_nograd": self.forwards_nograd,
                  "transformer_backwards": self.backwards}
        if self.monitor_forwards:   # only runs that measure: other records keep their fields
            counts.update(monitor_forwards=self.monitor_forwards, monitor_backwards=self.monitor_backwards)
        return counts

    def remove(self):
        self._handle.remove()


def update_counts(counter, stats, samples):
    """The passes of one step, the same names in every metrics record (the trainer's and the upstream
    adapter's): the counter's transformer forwards / backwards, what the policy update (its UpdateStats)
    reused and how it routed its groups, and the samples trained."""
    return {**counter.as_dict(), "transformer_forwards_reused": stats.forwards_reused,
            "jagg_groups": stats.jagg_groups, "exact_groups": stats.exact_groups, "samples": samples}


def reward_summary(rewards):
    """reward_mean / reward_std of every rank's rewards (gathered)."""
    return {"reward_mean": rewards.mean().item(), "reward_std": rewards.std().item() if rewards.numel() > 1 else 0.0}


def phase_times(t_start, t_rollout, t_end):
    """A step's time and its rollout and update phases, in seconds."""
    return {"step_time_s": t_end - t_start, "rollout_time_s": t_rollout - t_start, "update_time_s": t_end - t_rollout}


class MetricsWriter:
    """metrics.jsonl (one JSON line per step, with the run id) and upstream's reward.txt (line k =
    step k's mean reward), on rank 0 only.

    Each line is flushed as it is written, so a crash loses no finished step. A resumed run
    first cuts both files back to the checkpoint's step (atomically), so the steps it redoes
    are not logged twice; a torn last line (a crash mid-write) is dropped, never glued to the
    next record.
    """

    def __init__(self, output_dir, enabled, wandb_run=None, run_id=None, resume_step=None):
        self.enabled, self.wandb_run, self.run_id = enabled, wandb_run, run_id
        self.metrics_path = os.path.join(output_dir, "metrics.jsonl")
        self.reward_path = os.path.join(output_dir, "reward.txt")
        self.history = []
        if enabled:
            keep = None if resume_step is None else resume_step
            _rewrite_lines(self.metrics_path, lambda lines: _metrics_upto(lines, keep))
            _rewrite_lines(self.reward_path, lambda lines: lines if keep is None else lines[:keep])

    def write(self, record):
        if self.run_id is not None:
            record = {**record, "run_id": self.run_id}
        self.history.append(record)
        if not self.enabled:
            return
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        with open(self.reward_path, "a") as f:
            f.write(f"{record['reward_mean']}\n")
        if self.wandb_run is not None:
            self.wandb_run.log(record, step=record["step"])

    def records(self):
        """Every record in metrics.jsonl (earlier segments of a resumed run included)."""
        if not os.path.isfile(self.metrics_path):
            return []
        with open(self.metrics_path) as f:
            return [json.loads(line) for line in _metrics_upto(f.read().split("\n")[:-1], None)]

    def summary(self):
        if not self.history:
            return "no step ran"
        first, last = self.history[0], self.history[-1]
        n = len(self.history)
        mean_time = sum(r["step_time_s"] for r in self.history) / n
        return (f"{n} steps | reward {first['reward_mean']:.4f} -> {last['reward_mean']:.4f} | "
                f"{mean_time:.2f} s/step | per step: {last['transformer_forwards_grad']} grad fwd, "
                f"{last['transformer_forwards_nograd']} no-grad fwd, "
                f"{last.get('transformer_forwards_reused', 0)} reused from the rollout, "
                f"{last['transformer_backwards']} bwd")


def _metrics_upto(lines, step):
    """The records up to and including `step` (all when None); unparseable lines are dropped."""
    kept = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if step is None or (isinstance(record, dict) and record.get("step", 0) <= step):
            kept.append(line)
    return kept


def drop_torn_tail(path):
    """Cut a last line that lacks its newline (a write stopped mid-line: a kill, a full disk) off
    `path`, in place, so the next appended line starts a line of its own. Truncating needs no space."""
    if not os.path.isfile(path):
        return
    with open(path, "rb") as f:
        data = f.read()
    if data and not data.endswith(b"\n"):
        os.truncate(path, data.rfind(b"\n") + 1)


def append_line(path, line):
    """Append `line` and its newline; if the write fails (ENOSPC, EDQUOT) the file is cut back to
    its size before it, so no torn line is left, and the OSError is raised."""
    size = os.path.getsize(path) if os.path.isfile(path) else 0
    try:
        with open(path, "a") as f:
            f.write(line + "\n")
    except OSError:
        if os.path.isfile(path):
            os.truncate(path, size)
        raise


def _rewrite_lines(path, keep):
    """Replace `path` by keep(its complete lines), atomically; only if that changes it."""
    if not os.path.isfile(path):
        return
    with open(path) as f:
        text = f.read()
    lines = text.split("\n")
    complete = lines[:-1]  # the last piece is "" after a final newline, a torn line otherwise
    kept = keep(complete)
    new = "".join(line + "\n" for line in kept)
    if new == text:
        return
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(new)
    os.replace(tmp, path)
