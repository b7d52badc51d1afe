"""--jagg_frac auto: route to JAGG the group positions whose monitored cosine to the exact gradient
(jagg_patch.monitor) is high enough; the others run the exact per-step backward.

Per position the cosines are smoothed (an EMA over measurements, DECAY) and compared with
hysteresis: a position is routed to JAGG once its smoothed cosine reaches min_cos and leaves only
when it falls below min_cos - MARGIN, so a cosine that hovers at the threshold does not flip the
routing every measurement. Before its first measurement every position is exact. The cosines are
the same on every rank (summed over ranks), so every rank routes alike.
"""
import re

AUTO = "auto"
DECAY = 0.5     # weight of the previous smoothed value
MARGIN = 0.05   # hysteresis: leave JAGG below min_cos - MARGIN
_POSITION = re.compile(r"jagg_cos/g(\d+)")


class AutoRouting:
    def __init__(self, min_cos=0.8):
        self.min_cos = min_cos
        self.smoothed = {}   # position -> EMA of jagg_cos
        self.routed = set()

    def update(self, metrics):
        """Fold one measurement (the monitor's metrics) in; returns True when the routing changed."""
        before = set(self.routed)
        for name, cos in metrics.items():
            match = _POSITION.fullmatch(name)
            if not match:
                continue
            position = int(match.group(1))
            old = self.smoothed.get(position)
            value = cos if old is None else DECAY * old + (1 - DECAY) * cos
            self.smoothed[position] = value
            if value >= self.min_cos:
                self.routed.add(position)
            elif value < self.min_cos - MARGIN:
                self.routed.discard(position)
        return self.routed != before

    def state_dict(self):
        """What the routing carries from step to step (the smoothed cosines and the routed positions,
        the same on every rank), for a checkpoint."""
        return {"min_cos": self.min_cos, "smoothed": {str(p): v for p, v in sorted(self.smoothed.items())},
                "routed": sorted(self.routed)}

    def load_state_dict(self, state):
        self.smoothed = {int(p): float(v) for p, v in state["smoothed"].items()}
        self.routed = set(int(p) for p in state["routed"])

    def routes(self, position):
        return position in self.routed

    def describe(self):
        shown = ", ".join(f"g{p} {self.smoothed[p]:.3f}{' JAGG' if p in self.routed else ''}"
                          for p in sorted(self.smoothed))
        return (f"JAGG routing (auto, min cos {self.min_cos}): positions {sorted(self.routed)} to JAGG, the rest exact "
                f"(smoothed cos: {shown})")
