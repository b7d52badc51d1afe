"""Replacing dancegrpo's policy-update seams with JAGG (Liger-Kernel style).

Each trainer's `train_one_step` reads its module-globals `policy_update` and
`select_train_steps` at call time, so swapping those attributes switches a run to
JAGG and back. The trained grouping replaces only `policy_update`; the window
grouping (the authors' code) also replaces the choice of trained transitions.
"""
import dataclasses
import importlib
import os

import torch

from dancegrpo.algo.grpo import TrainSelection, UpdateStats

from .core import jagg_group_backward, resolve_backward, validate_jagg_config
from .monitor import Monitor
from .routing import AUTO, AutoRouting

from .plan import num_trained_windows, plan_groups, plan_windows
from .seams import check_seams

REPLACED = ("policy_update", "select_train_steps")
_ORIGINALS = {}  # (module name, seam) -> the original object, while patched


def _trained_groups(batch, window, jagg_frac):
    """Groups of W consecutive trained transitions (the paper): the same positions for every
    sample of the micro-batch, each sample with its own transitions."""
    # Vanilla trains the transitions in random order; JAGG needs denoising order.
    ks = batch.steps.sort(dim=1).values
    for group in plan_groups(range(ks.shape[1]), window, jagg_frac):
        yield batch, ks[:, list(group.members)], group


def _window_groups(batch, window, jagg_frac):
    """Contiguous trajectory windows (the authors): per window, the samples that train it."""
    num_transitions = batch.timesteps.numel() - 1  # the last transition is never trained
    for group in plan_windows(num_transitions, window, jagg_frac):
        rows = (batch.steps == group.members[0]).any(dim=1).nonzero().flatten()  # windows train whole
        if rows.numel():
            sub = batch if rows.numel() == batch.steps.shape[0] else batch.subset(rows)
            cols = torch.tensor(group.members, device=batch.steps.device).expand(rows.numel(), -1)
            yield sub, cols, group


def _reuse_of(sub, cols, reuse):
    """The rollout's outputs for the group's members where `reuse` allows them for this batch:
    on_policy only before the step's first optimizer step (exact), always also after (stale)."""
    if reuse == "off" or sub.rollout_output is None or not (sub.on_policy or reuse == "always"):
        return None
    return lambda j: sub.rollout_output(cols[:, j])


def make_policy_update(window=4, jagg_frac=0.6, mode="jagg", alpha="timestep", backward="joint",
                       grouping="trained", reuse="on_policy", monitor_every=0, monitor_samples=2, min_cos=0.8):
    """The JAGG replacement for dancegrpo.algo.grpo.policy_update, configured. reuse (REUSE_MODES):
    whether the middle members take the rollout's outputs instead of a no-grad forward.
    monitor_every N > 0: the live fidelity monitor (jagg_patch.monitor) at step 1 and every N steps,
    on `monitor_samples` samples; its Monitor is the update's `monitor` attribute.
    jagg_frac "auto": the positions whose monitored cosine reaches `min_cos` go to JAGG
    (jagg_patch.routing; the update's `routing` attribute); it needs the monitor."""
    validate_jagg_config(window, jagg_frac, mode, alpha, backward, grouping, reuse)
    if jagg_frac == AUTO and not monitor_every:
        raise ValueError("jagg_frac 'auto' routes by the monitor's cosines: give monitor_every N > 0 "
                         "(--jagg_monitor_every)")
    groups_of = _window_groups if grouping == "window" else _trained_groups
    monitor = Monitor(monitor_every, monitor_samples, alpha, resolve_backward(backward)) if monitor_every else None
    routing = AutoRouting(min_cos) if jagg_frac == AUTO else None

    def every_group(one):
        for sub, cols, group in groups_of(one, window, 1.0):
            yield group.index, sub, cols

    def routed_groups(batch):
        if routing is None:
            yield from groups_of(batch, window, jagg_frac)
            return
        for sub, cols, group in groups_of(batch, window, 1.0):
            yield sub, cols, dataclasses.replace(group, jagg=group.jagg and routing.routes(group.index))

    def policy_update(batch):
        stats = UpdateStats()
        if monitor is not None and monitor.due(batch):   # before the update: its gradient stays the run's own
            stats.metrics.update(monitor.measure(batch, every_group))
            if routing is not None and routing.update(stats.metrics) and int(os.environ.get("RANK", "0")) == 0:
                print(f"step {batch.step}: {routing.describe()}", flush=True)
        if routing is not None:
            stats.metrics["jagg_routed"] = sum(1 << p for p in routing.routed)   # bit p: position p runs JAGG
        for sub, cols, group in routed_groups(batch):   # cols: [m, w] transitions
            group_mode = mode if group.jagg else "exact"
            result = jagg_group_backward(lambda j: sub.predict(cols[:, j]),
                                         lambda j, v: sub.step_loss(cols[:, j], v),
                                         sub.timesteps.to(cols.device)[cols].T, group_mode, alpha,
                                         resolve_backward(backward), sub.backward, _reuse_of(sub, cols, reuse),
                                         lambda i, j: sub.predict_batched([cols[:, i], cols[:, j]]))
            stats.loss += result.loss
            stats.backward_calls += result.backward_calls
            stats.forwards_reused += result.forwards_reused * cols.shape[0]
            # Counted per sample, like transformer_backwards (2 per JAGG group).
            if group_mode == "exact":
                stats.exact_groups += cols.shape[0]
            else:
                stats.jagg_groups += cols.shape[0]
        return stats

    policy_update.jagg_config = dict(window=window, jagg_frac=jagg_frac, mode=mode, alpha=alpha,
                                     backward=backward, grouping=grouping, reuse=reuse, monitor_every=monitor_every,
                                     monitor_samples=monitor_samples, min_cos=min_cos)
    policy_update.monitor, policy_update.routing = monitor, routing
    policy_update.uses_rollout_outputs = reuse != "off" and mode != "exact" and (jagg_frac == AUTO or jagg_frac > 0)
    if routing is not None:
        # What the update carries across steps, saved with each checkpoint (dancegrpo.algo.grpo.update_state):
        # the routing alone; the monitor's cadence follows the step number.
        policy_update.state_dict = lambda: {"routing": routing.state_dict()}
        policy_update.load_state_dict = lambda state: routing.load_state_dict(state["routing"])
    return policy_update



def make_window_selection(window):
    """The authors' choice of trained transitions, replacing dancegrpo.algo.grpo.select_train_steps:
    per sample a random permutation of the windows, the first max(1, int(n_windows * fraction))
    trained whole; loss normaliser GA * n_trained_windows * W. -1 pads the samples that
    drew the shorter last window."""

    def select_train_steps(num_samples, num_transitions, timestep_fraction, generator=None):
        windows = [g.members for g in plan_windows(num_transitions, window, 1.0)]
        n_train = num_trained_windows(len(windows), timestep_fraction)
        rows = []
        for _ in range(num_samples):
            chosen = sorted(torch.randperm(len(windows), generator=generator)[:n_train].tolist())
            rows.append([k for g in chosen for k in windows[g]])
        steps = torch.full((num_samples, max(map(len, rows))), -1, dtype=torch.long)
        for i, row in enumerate(rows):
            steps[i, :len(row)] = torch.tensor(row)
        return TrainSelection(steps, n_train * window)

    return select_train_steps


def _trainer_modules(trainer_module):
    if trainer_module is None:
        import dancegrpo
        return [importlib.import_module(name) for name in dancegrpo.TRAINERS]
    if isinstance(trainer_module, str):
        return [importlib.import_module(trainer_module)]
    if isinstance(trainer_module, (list, tuple)):
        return [m for item in trainer_module for m in _trainer_modules(item)]
    return [trainer_module]


def apply_jagg(trainer_module=None, *, window=4, jagg_frac=0.6, mode="jagg", alpha="timestep", backward="joint",
               grouping="trained", reuse="on_policy", monitor_every=0, monitor_samples=2, min_cos=0.8):
    """Patch the update seams of one trainer module (object or name) or, by default, of every
    trainer in dancegrpo.TRAINERS. Applying again only changes the configuration.

    The defaults are the paper's grouping, alpha and joint backward, plus on-policy rollout reuse
    (exact: the same gradient). The command line's --jagg_backward defaults to auto instead (the
    cheapest form for the run's world size: see jagg_patch.core.resolve_backward)."""
    replacements = {"policy_update": make_policy_update(window, jagg_frac, mode, alpha, backward, grouping, reuse,
                                                        monitor_every, monitor_samples, min_cos)}
    if grouping == "window":
        replacements["select_train_steps"] = make_window_selection(window)
    modules = _trainer_modules(trainer_module)
    for module in modules:
        check_seams(module)
    for module in modules:
        for seam in REPLACED:
            original = _ORIGINALS.setdefault((module.__name__, seam), getattr(module, seam))
            setattr(module, seam, replacements.get(seam, original))
    return modules


def revert_jagg(trainer_module=None):
    """Put the original seam objects back (default: every module patched so far)."""
    names = None if trainer_module is None else {m.__name__ for m in _trainer_modules(trainer_module)}
    for name, seam in list(_ORIGINALS):
        if names is None or name in names:
            setattr(importlib.import_module(name), seam, _ORIGINALS.pop((name, seam)))


def is_patched(trainer_module):
    name = _trainer_modules(trainer_module)[0].__name__
    return any(key[0] == name for key in _ORIGINALS)


__all__ = ["apply_jagg", "revert_jagg", "make_policy_update", "make_window_selection", "is_patched"]
