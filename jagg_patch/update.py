"""The JAGG policy update: which transitions form each group (the one group enumeration of the
update, the monitor and the tools), how groups are routed (jagg_frac, or auto by the monitor), the
one adapter from dancegrpo's UpdateBatch to `core.jagg_group_backward`, and the authors' window
selection of trained transitions. `make_policy_update(config)` (a JaggUpdate) and
`make_window_selection(window)` are the objects `jagg_patch.patch` puts into a trainer's seams.
"""
import dataclasses
from typing import NamedTuple

import torch

from dancegrpo.algo.grpo import TrainSelection, UpdateStats
from dancegrpo.utils.launch import print_on_rank0

from .config import as_config
from .core import jagg_group_backward, resolve_backward
from .monitor import Monitor
from .plan import Group, num_trained_windows, plan_groups, plan_windows
from .routing import AutoRouting


class TrainedGroup(NamedTuple):
    """One group the samples of a micro-batch train: `rows`, the indices of the samples that train it
    (every sample under the paper's grouping); `cols` [len(rows), w], member j of row i is transition
    cols[i, j]; `group`, its place in the plan (plan.Group: index, members, whether it runs JAGG)."""
    rows: torch.Tensor
    cols: torch.Tensor
    group: Group


def trained_groups(steps, window, jagg_frac):
    """The paper's groups: W consecutive trained transitions, the same positions for every sample,
    each sample with its own transitions."""
    # Vanilla trains the transitions in random order; JAGG needs denoising order.
    ks = steps.sort(dim=1).values
    every = torch.arange(ks.shape[0], device=ks.device)
    for group in plan_groups(range(ks.shape[1]), window, jagg_frac):
        yield TrainedGroup(every, ks[:, list(group.members)], group)


def window_groups(steps, num_transitions, window, jagg_frac):
    """The authors' groups: contiguous trajectory windows; per window, the samples that train it
    (whole: its first transition stands for it; -1 pads train nothing)."""
    for group in plan_windows(num_transitions, window, jagg_frac):
        rows = (steps == group.members[0]).any(dim=1).nonzero().flatten()
        if rows.numel():
            cols = torch.tensor(group.members, device=steps.device).expand(rows.numel(), -1)
            yield TrainedGroup(rows, cols, group)


def groups_of(steps, num_transitions, window, jagg_frac, grouping="trained"):
    """The TrainedGroup of every group the samples of `steps` [N, n] train."""
    if grouping == "window":
        return window_groups(steps, num_transitions, window, jagg_frac)
    return trained_groups(steps, window, jagg_frac)


class BatchGroup(NamedTuple):
    """A group of an UpdateBatch: `sub`, the batch of the samples that train it (the batch itself when
    all do), `cols` and `group` as in TrainedGroup."""
    sub: object
    cols: torch.Tensor
    group: Group


def batch_groups(batch, window, jagg_frac, grouping="trained"):
    """The BatchGroup of every group of an UpdateBatch (the last transition is never trained, so a
    trajectory of S steps has S-1 trainable transitions)."""
    num_transitions = batch.timesteps.numel() - 1
    for found in groups_of(batch.steps, num_transitions, window, jagg_frac, grouping):
        whole = found.rows.numel() == batch.steps.shape[0]
        yield BatchGroup(batch if whole else batch.subset(found.rows), found.cols, found.group)


def group_backward(sub, cols, mode, alpha, backward, run_backward=None, reuse=None):
    """One group's gradient from an UpdateBatch: member j of sample i is transition cols[i, j]."""
    return jagg_group_backward(lambda j: sub.predict(cols[:, j]), lambda j, v: sub.step_loss(cols[:, j], v),
                               sub.timesteps.to(cols.device)[cols].T, mode, alpha, backward, run_backward, reuse,
                               lambda i, j: sub.predict_batched([cols[:, i], cols[:, j]]))


def rollout_reuse(sub, cols, reuse):
    """The rollout's outputs for the group's members where `reuse` allows them for this batch:
    on_policy only before the step's first optimizer step (exact), always also after (stale)."""
    if reuse == "off" or sub.rollout_output is None or not (sub.on_policy or reuse == "always"):
        return None
    return lambda j: sub.rollout_output(cols[:, j])


def _add_group(stats, result, group_mode, samples):
    stats.loss += result.loss
    stats.backward_calls += result.backward_calls
    stats.forwards_reused += result.forwards_reused * samples
    # Counted per sample, like transformer_backwards (2 per JAGG group).
    if group_mode == "exact":
        stats.exact_groups += samples
    else:
        stats.jagg_groups += samples


class JaggUpdate:
    """The JAGG replacement for dancegrpo.algo.grpo.policy_update, configured by a JaggConfig: called
    with an UpdateBatch, it computes the micro-batch's gradient group by group. With monitor_every N > 0
    the live fidelity monitor (jagg_patch.monitor) measures at step 1 and every N steps; jagg_frac
    "auto" routes the positions whose monitored cosine reaches min_cos (jagg_patch.routing).

    jagg_config           the configuration
    monitor, routing      the monitor and the auto routing (None when not configured)
    uses_rollout_outputs  whether the rollout should keep its model outputs for this update
    state_dict / load_state_dict   what the update carries across steps (the auto routing and the
                          groups' layout it indexes), for checkpoints; None without auto routing
    """

    def __init__(self, config):
        self.jagg_config = config
        self.monitor = (Monitor(config.monitor_every, config.monitor_samples, config.alpha,
                                resolve_backward(config.backward)) if config.monitor_every else None)
        self.routing = AutoRouting(config.min_cos) if config.auto else None
        self.uses_rollout_outputs = config.uses_rollout_outputs
        self._restored = None   # a checkpoint's routing, applied at the first batch, once its layout is known
        self._layout = {}

    def __call__(self, batch):
        config, monitor, routing = self.jagg_config, self.monitor, self.routing
        stats = UpdateStats()
        if routing is not None:
            if self._restored is not None:
                _restore_routing(routing, monitor, self._restored, _layout(config, batch))
                self._restored = None
            self._layout = _layout(config, batch)
        if monitor is not None and monitor.due(batch):   # before the update: its gradient stays the run's own
            measured, complete = monitor.measure(batch, self._every_group, group_backward)
            stats.metrics.update(measured)
            if complete and routing is not None and routing.update(measured):
                print_on_rank0(f"step {batch.step}: {routing.describe()}")
        if routing is not None:
            stats.metrics["jagg_routed"] = sum(1 << p for p in routing.routed)   # bit p: position p runs JAGG
        for sub, cols, group in self._routed_groups(batch):   # cols: [m, w] transitions
            group_mode = config.mode if group.jagg else "exact"
            result = group_backward(sub, cols, group_mode, config.alpha, resolve_backward(config.backward),
                                    sub.backward, rollout_reuse(sub, cols, config.reuse))
            _add_group(stats, result, group_mode, cols.shape[0])
        return stats

    def _every_group(self, one):
        """(position, sub-batch, cols) of every group, routed or not: what the monitor measures."""
        config = self.jagg_config
        for sub, cols, group in batch_groups(one, config.window, 1.0, config.grouping):
            yield group.index, sub, cols

    def _routed_groups(self, batch):
        config = self.jagg_config
        if self.routing is None:
            yield from batch_groups(batch, config.window, config.jagg_frac, config.grouping)
            return
        for sub, cols, group in batch_groups(batch, config.window, 1.0, config.grouping):
            yield BatchGroup(sub, cols, dataclasses.replace(group, jagg=group.jagg and self.routing.routes(group.index)))

    # With the groups' layout, which the routed positions index: a resume with another window, grouping
    # or number of trained transitions starts its routing afresh. The monitor's cadence follows the
    # step number, so the routing is all a checkpoint keeps.
    @property
    def state_dict(self):
        if self.routing is None:
            return None
        return lambda: {"routing": self.routing.state_dict(), "layout": dict(self._layout)}

    @property
    def load_state_dict(self):
        if self.routing is None:
            return None
        return self._keep_restored

    def _keep_restored(self, state):
        self._restored = state


def make_policy_update(config=None, **settings):
    """A JaggUpdate of a JaggConfig (or of its settings by name)."""
    return JaggUpdate(as_config(config, **settings))


def _layout(config, batch):
    """What a group position means: the window, the grouping and the trained transitions per sample."""
    return {"window": config.window, "grouping": config.grouping, "trained": int(batch.steps.shape[1])}


def _restore_routing(routing, monitor, state, layout):
    """Load a checkpoint's routing if its positions are this run's groups; otherwise start afresh (every
    position exact) and measure at this step rather than at the next scheduled one."""
    saved = state.get("layout") or {}
    if saved and saved != layout:
        changed = ", ".join(f"{k} {saved.get(k)} -> {v}" for k, v in layout.items() if saved.get(k) != v)
        print_on_rank0(f"notice: the checkpoint's --jagg_frac auto routing was measured on other groups ({changed}): "
                       "it starts afresh, every position exact until measured at this step")
        monitor.measure_this_step()
    else:
        routing.load_state_dict(state["routing"])


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


def seam_replacements(config):
    """{seam: replacement} of a trainer module for `config`: the policy update, and under the window
    grouping the choice of trained transitions too."""
    replacements = {"policy_update": make_policy_update(config)}
    if config.grouping == "window":
        replacements["select_train_steps"] = make_window_selection(config.window)
    return replacements
