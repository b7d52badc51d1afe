"""The PPO statistics GRPO runs are compared by, as Flow-GRPO logs them, over a step's trained
transitions (every (sample, transition) the policy update scores once):

    ratio_mean / ratio_min / ratio_max   r = exp(logp - logp_old), as the loss computes it
    clip_frac                            the fraction with |r - 1| > clip_range (outside the clip)
    approx_kl                            0.5 mean((logp - logp_old)^2), the sampling policy to the current

Before the step's first optimizer step r is 1 up to the arithmetic: exactly 1 where the update's
model output is the rollout's (rollout reuse; a recompute with the rollout's rounding), off by the
difference otherwise (a recompute whose kernels round otherwise, as another batch shape can on a GPU:
measured 3e-3 to 0.18 on the digits models, past upstream's clip range of 1e-4; docs/jagg.md). A
measurement beside the update (JAGG's monitor) is kept out with `apart()`, as its transformer passes
are.
"""
import contextlib
import math

import torch

FIELDS = ("ratio_mean", "ratio_min", "ratio_max", "clip_frac", "approx_kl")


class RatioMeter:
    """Accumulates the statistics of one step on the device (no host sync per transition);
    keep=True also keeps every (sample, transition, ratio) recorded, for tools that compare which
    transitions each update clipped."""

    def __init__(self, keep=False):
        self.keep = keep
        self._apart = False
        self.reset()

    def reset(self):
        self._count = 0      # transitions recorded (a host count: no device tensor per record)
        self._sums = None    # float64 on the device: [sum r, clipped, sum 0.5 d^2, min r, -max r]
        self.kept = []       # (sample indices [m], transitions [m], ratios [m]) per record, with keep

    @contextlib.contextmanager
    def apart(self):
        """Records inside are a measurement's, not the update's: dropped."""
        self._apart = True
        try:
            yield
        finally:
            self._apart = False

    def record(self, log_prob, old_log_prob, clip_range, samples=None, transitions=None):
        """One scoring of m transitions: log-probs [m] under the current policy and the rollout's."""
        if self._apart:
            return
        with torch.no_grad():
            delta = log_prob.detach() - old_log_prob
            ratio = torch.exp(delta)   # the loss's own float32 ratio, so clip_frac counts what the clip sees
            ratio64, delta64 = ratio.double(), delta.double()
            row = torch.stack([ratio64.sum(), ((ratio - 1).abs() > clip_range).double().sum(),
                               0.5 * (delta64 ** 2).sum(), ratio64.min(), -ratio64.max()])
        self._count += ratio.numel()
        if self._sums is None:
            self._sums = row
        else:
            self._sums = torch.cat([self._sums[:3] + row[:3], torch.minimum(self._sums[3:], row[3:])])
        if self.keep:
            self.kept.append(tuple(None if t is None else t.detach().cpu() for t in (samples, transitions, ratio)))

    def summary(self, device):
        """{FIELDS: value} over every rank's records (collective: every rank calls it); {} when no
        rank recorded anything."""
        import torch.distributed as dist
        sums = self._sums if self._sums is not None else torch.tensor(
            [0.0, 0.0, 0.0, math.inf, math.inf], dtype=torch.float64)
        totals = torch.cat([torch.tensor([float(self._count)], dtype=torch.float64), sums[:3].cpu()]).to(device)
        extremes = sums[3:].to(device).clone()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(totals)
            dist.all_reduce(extremes, op=dist.ReduceOp.MIN)
        count, ratio_sum, clipped, kl_sum = totals.tolist()
        low, neg_high = extremes.tolist()
        if count == 0:
            return {}
        return {"ratio_mean": ratio_sum / count, "ratio_min": low, "ratio_max": -neg_high,
                "clip_frac": clipped / count, "approx_kl": kl_sum / count}
