"""What a mode of jagg_patch.tools.bench_update is: a named record (the JAGG mode, backward form,
rollout reuse, whether --jagg_frac auto routes it), all of them in one table, and the update each
one runs."""
from dataclasses import dataclass

from ..config import JaggConfig
from ..core import resolve_backward
from ..update import make_policy_update
from .tool_args import DEFAULT_MODES


@dataclass(frozen=True)
class BenchMode:
    name: str
    jagg_mode: str = None    # None: vanilla, dancegrpo's own update
    backward: str = "joint"
    reuse: str = "off"
    auto: bool = False       # --jagg_frac auto, its monitor measuring in every timed run
    deferred: bool = False   # vanilla's own update through jagg_patch.deferred's proxy

    @property
    def vanilla(self):
        return self.jagg_mode is None

    def schedule(self, on_policy):
        """The cost model's pass schedule of this mode for a sample (jagg_patch.tools.cost_model)."""
        reuse = self.reuse != "off" and on_policy
        if self.deferred:
            return "deferred_reuse" if reuse else "deferred"
        return "reuse" if reuse else "project"


def _jagg_modes():
    modes = [BenchMode("vanilla")]
    for backward, suffix in (("joint", ""), ("split", "_split"), ("batched", "_batched")):
        for reuse, tail in (("off", ""), ("on_policy", "_reuse")):
            modes.append(BenchMode(f"jagg{suffix}{tail}", "jagg", backward, reuse))
    modes += [BenchMode("exact", "exact"), BenchMode("endpoints", "endpoints")]
    for backward, suffix in (("split", ""), ("batched", "_batched")):
        for reuse, tail in (("off", ""), ("on_policy", "_reuse")):
            modes.append(BenchMode(f"deferred{suffix}{tail}", "jagg", backward, reuse, deferred=True))
    return modes


_FIXED = _jagg_modes()
# Every JAGG mode of the paper's method also runs routed by --jagg_frac auto, as "<name>_auto".
MODES = {m.name: m for m in _FIXED + [BenchMode(f"{m.name}_auto", m.jagg_mode, m.backward, m.reuse, True)
                                      for m in _FIXED if m.jagg_mode == "jagg" and not m.deferred]}
AUTO_SUFFIX = "_auto"


def parse_modes(text):
    """The BenchModes of a --bench_modes list; vanilla must be among them."""
    names = [m.strip() for m in text.split(",") if m.strip()]
    if any(name not in MODES for name in names) or "vanilla" not in names:
        raise SystemExit(f"error: --bench_modes must include vanilla and come from {DEFAULT_MODES} (a JAGG mode may "
                         f"end in {AUTO_SUFFIX}), got {names}")
    return [MODES[name] for name in names]


def mode_config(args, mode):
    """The JaggConfig of a JAGG mode with the run's --jagg_* settings."""
    return JaggConfig(window=args.jagg_window, jagg_frac="auto" if mode.auto else args.jagg_frac,
                      mode=mode.jagg_mode, alpha=args.jagg_alpha, backward=mode.backward,
                      grouping=args.jagg_grouping, reuse=mode.reuse, monitor_every=1 if mode.auto else 0,
                      monitor_samples=args.jagg_monitor_samples, min_cos=args.jagg_min_cos)


def make_update(args, mode):
    """The update a mode runs: vanilla's own for vanilla and the deferred modes (their proxy is the
    bench's), else the JaggUpdate of its config."""
    if mode.vanilla or mode.deferred:
        from dancegrpo.algo.grpo import policy_update
        return policy_update
    return make_policy_update(mode_config(args, mode))


def headline_mode(args, names, world_size):
    """The name of the bench mode that runs what the configured --jagg_backward / --jagg_reuse_rollout
    run (None when it was not measured and neither was jagg)."""
    backward = resolve_backward(args.jagg_backward, world_size)
    name = {"joint": "jagg", "split": "jagg_split", "batched": "jagg_batched"}[backward]
    name += "" if args.jagg_reuse_rollout == "off" else "_reuse"
    return name if name in names else ("jagg" if "jagg" in names else None)
