"""--jagg_frac auto: route to JAGG the group positions whose monitored cosine to the exact gradient
(jagg_patch.monitor) is measured to be high enough; the others run the exact per-step backward.

A measurement is a mean over a few samples, so it is compared with the threshold through a one-sided
95% confidence bound, not as it is: per position the monitor gives the mean cosine, its sample
standard deviation and the samples it is over (jagg_cos/gP, jagg_cos_sd/gP, jagg_cos_n/gP). The
means are smoothed over measurements (an EMA, DECAY), the variance of that smoothed mean with them
(the EMA's weights squared times each measurement's se^2 = sd^2 / n), and the bound is
smoothed -+ t * sqrt(variance), t Student's for the latest measurement's n - 1 degrees of freedom.
A position is routed to JAGG once its LOWER bound reaches min_cos and leaves only when its UPPER
bound falls below min_cos; while the bound straddles the threshold the routing stays as it is, so a
cosine within its own noise of the threshold neither routes nor flips. One sample gives no spread,
hence no bound: auto needs at least two (checked in JaggConfig). Before its first measurement every
position is exact. The cosines are the same on every rank (summed over ranks), so every rank routes
alike.
"""
import math
import re

AUTO = "auto"
DECAY = 0.5     # weight of the previous smoothed value
CONFIDENCE = 0.95
# One-sided 95% quantiles of Student's t for 1..30 degrees of freedom; the normal's beyond.
_T95 = (6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812, 1.796, 1.782, 1.771, 1.761, 1.753,
        1.746, 1.740, 1.734, 1.729, 1.725, 1.721, 1.717, 1.714, 1.711, 1.708, 1.706, 1.703, 1.701, 1.699, 1.697)
_Z95 = 1.645
_POSITION = re.compile(r"jagg_cos/g(\d+)")


def t_quantile(dof):
    """The one-sided 95% quantile of Student's t with `dof` degrees of freedom (inf for none)."""
    if dof < 1:
        return math.inf
    return _T95[dof - 1] if dof <= len(_T95) else _Z95


class AutoRouting:
    def __init__(self, min_cos=0.8):
        self.min_cos = min_cos
        self.smoothed = {}   # position -> EMA of the mean jagg_cos
        self.variance = {}   # position -> variance of that EMA
        self.half_width = {}   # position -> the bound's half-width at the latest measurement
        self.routed = set()

    def update(self, metrics):
        """Fold one measurement (the monitor's metrics) in; returns True when the routing changed."""
        before = set(self.routed)
        for name, cos in metrics.items():
            match = _POSITION.fullmatch(name)
            if not match:
                continue
            position = match.group(1)
            n = int(metrics.get(f"jagg_cos_n/g{position}", 1))
            sd = float(metrics.get(f"jagg_cos_sd/g{position}", 0.0))
            self._fold(int(position), cos, sd * sd / n if n > 1 else math.inf, n)
        return self.routed != before

    def _fold(self, position, cos, se2, n):
        old = self.smoothed.get(position)
        if old is None:
            value, variance = cos, se2
        else:
            value = DECAY * old + (1 - DECAY) * cos
            variance = DECAY ** 2 * self.variance[position] + (1 - DECAY) ** 2 * se2
        self.smoothed[position], self.variance[position] = value, variance
        half = t_quantile(n - 1) * math.sqrt(variance) if math.isfinite(variance) else math.inf
        self.half_width[position] = half
        if value - half >= self.min_cos:
            self.routed.add(position)
        elif value + half < self.min_cos:
            self.routed.discard(position)

    def state_dict(self):
        """What the routing carries from step to step (the smoothed cosines, their variances, the bounds
        and the routed positions, the same on every rank), for a checkpoint."""
        return {"min_cos": self.min_cos,
                "smoothed": {str(p): v for p, v in sorted(self.smoothed.items())},
                "variance": {str(p): v for p, v in sorted(self.variance.items())},
                "half_width": {str(p): v for p, v in sorted(self.half_width.items())},
                "routed": sorted(self.routed)}

    def load_state_dict(self, state):
        self.smoothed = {int(p): float(v) for p, v in state["smoothed"].items()}
        # A checkpoint of the routing before it kept variances: its means, with no bound (inf) until measured.
        self.variance = {int(p): float(v) for p, v in state.get("variance", {}).items()}
        self.half_width = {int(p): float(v) for p, v in state.get("half_width", {}).items()}
        for p in self.smoothed:
            self.variance.setdefault(p, math.inf)
            self.half_width.setdefault(p, math.inf)
        self.routed = set(int(p) for p in state["routed"])

    def routes(self, position):
        return position in self.routed

    def describe(self):
        shown = ", ".join(f"g{p} {self.smoothed[p]:.4f} ± {self.half_width[p]:.4f}"
                          f"{' JAGG' if p in self.routed else ''}" for p in sorted(self.smoothed))
        return (f"JAGG routing (auto, min cos {self.min_cos}, {CONFIDENCE:.0%} bounds): positions "
                f"{sorted(self.routed)} to JAGG, the rest exact (smoothed cos ± bound: {shown})")
