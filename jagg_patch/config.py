"""One JAGG configuration: every setting of the update in one frozen object, checked once when it
is made, then passed by name (`make_policy_update(config)`, `apply_jagg(config)`,
`jagg_patch.upstream.apply(module, config)`, the tools).

    from jagg_patch import JaggConfig
    config = JaggConfig(window=4, jagg_frac=0.6)                      # the paper
    authors = JaggConfig(window=4, jagg_frac=1.0, grouping="window", alpha="index", backward="split")

A new JAGG setting is one field here (its check in `__post_init__`), one flag in
`jagg_patch.cli.add_jagg_args` read by `from_args`, and the code that uses it.
"""
import dataclasses
from dataclasses import dataclass

from .settings import validate_jagg_config
from .routing import AUTO


# Measured (docs/jagg.md, "Routing by a measurement"): at 8 samples repeated measurements of one model route
# alike wherever its cosines lie further from min_cos than their own noise; at 2, one pair in two did.
MONITOR_SAMPLES = 8
AUTO_MONITOR_EVERY = 10   # --jagg_frac auto without --jagg_monitor_every: a measurement every 10 steps
DEFAULT_MIN_COS = 0.8


@dataclass(frozen=True)
class JaggConfig:
    window: int = 4                # W: transitions per group
    jagg_frac: object = 0.6        # fraction of the groups (highest noise first) through JAGG, or "auto"
    mode: str = "jagg"             # core.MODES
    alpha: str = "timestep"        # core.ALPHA_RULES: the paper's text | the authors' code
    backward: str = "joint"        # core.BACKWARD_CHOICES ("auto": resolved per call by the world size)
    grouping: str = "trained"      # core.GROUPINGS
    reuse: str = "on_policy"       # core.REUSE_MODES: middle members' outputs from the rollout
    monitor_every: int = 0         # the live fidelity monitor at step 1 and every N steps; 0: off
    monitor_samples: int = MONITOR_SAMPLES   # the step's first samples it measures on (auto: >= 2)
    min_cos: float = DEFAULT_MIN_COS   # with jagg_frac "auto": the smoothed cosine a position needs

    def __post_init__(self):
        validate_jagg_config(self.window, self.jagg_frac, self.mode, self.alpha, self.backward, self.grouping,
                             self.reuse)
        for name, least in (("monitor_every", 0), ("monitor_samples", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"JAGG {name} must be an integer >= {least}, got {value!r}")
        if isinstance(self.min_cos, bool) or not isinstance(self.min_cos, (int, float)) \
                or not -1.0 <= self.min_cos <= 1.0:
            raise ValueError(f"JAGG min_cos must be a cosine in [-1, 1], got {self.min_cos!r}")
        if self.jagg_frac == AUTO and not self.monitor_every:
            raise ValueError("jagg_frac 'auto' routes by the monitor's cosines: give monitor_every N > 0 "
                             "(--jagg_monitor_every)")
        if self.jagg_frac == AUTO and self.monitor_samples < 2:
            raise ValueError("jagg_frac 'auto' routes by a confidence bound on the monitor's cosines, which needs "
                             "their spread: give monitor_samples >= 2 (--jagg_monitor_samples)")

    @property
    def auto(self):
        return self.jagg_frac == AUTO

    @property
    def uses_rollout_outputs(self):
        """Whether the update reads the rollout's model outputs (the rollout must keep them)."""
        return self.reuse != "off" and self.mode != "exact" and (self.auto or self.jagg_frac > 0)

    def replace(self, **changes):
        """A copy with `changes` (checked as a new config)."""
        return dataclasses.replace(self, **changes)

    def as_dict(self):
        return dataclasses.asdict(self)

    @classmethod
    def from_args(cls, args):
        """The config of the parsed --jagg_* flags (jagg_patch.cli.add_jagg_args); the two flags that default
        to "not given" (None) take their defaults here (jagg_patch.cli.monitor_for_auto says them)."""
        every, min_cos = monitor_flag_values(args.jagg_frac, args.jagg_monitor_every, args.jagg_min_cos)
        return cls(window=args.jagg_window, jagg_frac=args.jagg_frac, mode=args.jagg_mode, alpha=args.jagg_alpha,
                   backward=args.jagg_backward, grouping=args.jagg_grouping, reuse=args.jagg_reuse_rollout,
                   monitor_every=every, monitor_samples=args.jagg_monitor_samples, min_cos=min_cos)


def monitor_flag_values(jagg_frac, every, min_cos):
    """(--jagg_monitor_every, --jagg_min_cos) with "not given" (None) replaced by its default: auto measures
    every AUTO_MONITOR_EVERY steps, a fixed fraction does not monitor; min_cos DEFAULT_MIN_COS."""
    if every is None:
        every = AUTO_MONITOR_EVERY if jagg_frac == AUTO else 0
    return every, DEFAULT_MIN_COS if min_cos is None else min_cos


def as_config(config=None, **settings):
    """`config` (a JaggConfig), with `settings` changed; or, without one, a JaggConfig of the keyword
    settings: the documented keyword form of every entry point builds the config here."""
    if config is None:
        return JaggConfig(**settings)
    if not isinstance(config, JaggConfig):
        raise TypeError(f"expected a jagg_patch.JaggConfig, got {type(config).__name__}; pass the settings by name "
                        "(window=4, jagg_frac=0.6, ...) or JaggConfig(...)")
    return config.replace(**settings) if settings else config
