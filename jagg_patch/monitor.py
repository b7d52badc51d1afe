"""The live fidelity monitor (--jagg_monitor_every N): at step 1 and every N training steps, on the
step's first --jagg_monitor_samples samples (those of its first micro-batches), the exact gradient of every
group position next to JAGG's and the endpoints ablation's. Logged per position with the step:
jagg_cos/gP, jagg_relerr/gP, endpoints_cos/gP, endpoints_relerr/gP (the mean over the monitored
samples), JAGG's cosine's spread over them (jagg_cos_sd/gP, jagg_cos_n/gP: what the auto routing's
confidence bound is made of), with monitor_time_s; the passes are counted apart (monitor_forwards,
monitor_backwards).

A position is the group's index: along each sample's trained transitions in denoising order
(grouping trained) or along the trajectory (grouping window: the window's index).

The monitor does not change the training: its gradients go through the batch's gradient probe
(dancegrpo.engines.probe: fresh .grad tensors, the step's own put back afterwards, the same tensor
objects; under DeepSpeed autograd.grad into a buffer of its own, past ZeRO's hooks), its passes run
under a forked random state, and the update that follows is the one the run makes without it. The
cosines are of the full gradient, the mean of the ranks' monitored samples: each rank holds a part
of it (its FSDP shard, or its slice of the all-reduced mean under DeepSpeed) and the dot products
are summed over ranks, not the vectors.
"""
import math
import time
from collections import defaultdict

import torch

from dancegrpo.engines.probe import GradProbe
from dancegrpo.utils.launch import print_on_rank0

from .similarity import gradient_similarity
from .spread import spread as sample_spread

MEASURED = ("jagg", "endpoints")


def _probe_of(batch):
    if batch.gradient_probe is not None:
        return batch.gradient_probe()
    if batch.backward is not None:
        raise ValueError("the JAGG monitor cannot read this engine's gradients: its backward is its own and "
                         "its UpdateBatch gives no gradient_probe")
    return GradProbe(batch.parameters())


def spread(values):
    """Per position, the spread of JAGG's cosine over the measured samples, for the routing's
    confidence bound (jagg_patch.routing): jagg_cos_sd/gP, the sample standard deviation (0 for one
    sample), and jagg_cos_n/gP, the samples it is over (those with a gradient to compare)."""
    out = {}
    for name, cosines in values.items():
        if not name.startswith("jagg_cos/"):
            continue
        position = name[len("jagg_cos/"):]
        out[f"jagg_cos_sd/{position}"] = sample_spread(cosines)["sd"]
        out[f"jagg_cos_n/{position}"] = len(cosines)
    return out


class Monitor:
    """Measures JAGG's fidelity beside the run's own update."""

    def __init__(self, every, samples, alpha="timestep", backward="split"):
        # every >= 0 and samples >= 1: checked where the settings are made (jagg_patch.config.JaggConfig)
        self.every, self.samples, self.alpha, self.backward = every, samples, alpha, backward
        self._step, self._taken, self._values, self._seconds = None, 0, defaultdict(list), 0.0
        self._unscheduled = False

    def measure_this_step(self):
        """Measure at the next step begun, whatever its number (a routing that starts afresh mid-run)."""
        self._unscheduled = True

    def due(self, batch):
        """Whether this micro-batch is measured: in step 1 and every `every`-th step, the first
        micro-batches until `samples` samples are measured (one micro-batch when it holds them all; a
        micro-batch of one sample, as upstream's, measures the step's first `samples` samples)."""
        if not self.every:
            return False
        if batch.step != self._step:
            self._step, self._values, self._seconds = batch.step, defaultdict(list), 0.0
            measured_step = batch.step == 1 or batch.step % self.every == 0 or self._unscheduled
            self._unscheduled = False
            self._taken = 0 if measured_step else self.samples
        return self._taken < self.samples

    def measure(self, batch, groups, group_backward):
        """The metrics of the measurement so far in this step (means over every sample measured in
        it), and whether it is complete (`samples` samples measured): (metrics, complete). groups(sub)
        yields (position, sub-batch, cols [m, w]) of a one-sample batch, every group (routing plays no
        part); group_backward is the update's own (jagg_patch.update.group_backward), so the monitor
        measures the passes the update runs."""
        start = time.perf_counter()
        rows = min(self.samples - self._taken, batch.steps.shape[0])
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        with _probe_of(batch) as probe, torch.random.fork_rng(devices=devices), batch.counted_apart():
            for row in range(rows):
                one = batch.subset(torch.tensor([row], device=batch.steps.device))
                for position, sub, cols in groups(one):
                    if cols.shape[1] >= 2:
                        self._measure_group(probe, sub, cols, position, self._values, group_backward)
        self._taken += rows
        self._seconds += time.perf_counter() - start
        values = self._values
        metrics = {name: sum(v) / len(v) for name, v in sorted(values.items())}
        metrics.update(spread(values))
        metrics["monitor_time_s"] = self._seconds
        complete = self._taken >= self.samples
        if complete and not values:
            # Every monitored sample's gradient was zero (the same on every rank: summed over them).
            metrics["monitor_skipped"] = 1
            print_on_rank0(f"step {batch.step}: the JAGG monitor measured nothing: the gradient of its samples is "
                           "zero (advantage 0: every reward of their group alike), so there is no direction to "
                           "compare; --jagg_frac auto keeps its routing until the next measurement")
        return metrics, complete

    def _measure_group(self, probe, sub, cols, position, values, group_backward):
        def gradient(mode):
            group_backward(sub, cols, mode, self.alpha, self.backward, probe.backward)
            return probe.take()
        exact = gradient("exact")
        for mode in MEASURED:
            # Summed over ranks (each holds its shard); nan where a gradient is zero (advantage 0): skipped.
            result = gradient_similarity(exact, gradient(mode))
            if not math.isnan(result.cos):
                values[f"{mode}_cos/g{position}"].append(result.cos)
                values[f"{mode}_relerr/g{position}"].append(result.relerr)
