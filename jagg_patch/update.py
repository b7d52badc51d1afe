"""The JAGG policy update: which transitions form each group (the one group enumeration of the
update, the monitor and the tools), how groups are routed (jagg_frac, or auto by the monitor), the
one adapter from dancegrpo's UpdateBatch to `core.jagg_group_backward`, and the authors' window
selection of trained transitions. `make_policy_update(config)` and `make_window_selection(window)`
are the objects `jagg_patch.patch` puts into a trainer's seams.
"""
import dataclasses

import torch

from dancegrpo.algo.grpo import TrainSelection, UpdateStats
from dancegrpo.utils.launch import print_on_rank0

from .config import as_config
from .core import jagg_group_backward, resolve_backward
from .monitor import Monitor
from .plan import num_trained_windows, plan_groups, plan_windows
from .routing import AutoRouting


def trained_groups(steps, window, jagg_frac):
    """The paper's groups: W consecutive trained transitions, the same positions for every sample,
    each sample with its own transitions. Yields (rows None = every sample, cols [m, w], group)."""
    # Vanilla trains the transitions in random order; JAGG needs denoising order.
    ks = steps.sort(dim=1).values
    for group in plan_groups(range(ks.shape[1]), window, jagg_frac):
        yield None, ks[:, list(group.members)], group


def window_groups(steps, num_transitions, window, jagg_frac):
    """The authors' groups: contiguous trajectory windows; per window, the rows of the samples that
    train it (whole: its first transition stands for it; -1 pads train nothing)."""
    for group in plan_windows(num_transitions, window, jagg_frac):
        rows = (steps == group.members[0]).any(dim=1).nonzero().flatten()
        if rows.numel():
            cols = torch.tensor(group.members, device=steps.device).expand(rows.numel(), -1)
            yield rows, cols, group


def groups_of(steps, num_transitions, window, jagg_frac, grouping="trained"):
    """(rows, cols [m, w] transitions, Group) of every group the samples of `steps` [N, n] train:
    rows None (every sample) or the indices of the samples that train the group."""
    if grouping == "window":
        return window_groups(steps, num_transitions, window, jagg_frac)
    return trained_groups(steps, window, jagg_frac)


def batch_groups(batch, window, jagg_frac, grouping="trained"):
    """(sub-batch, cols, Group) of every group of an UpdateBatch (the last transition is never
    trained, so a trajectory of S steps has S-1 trainable transitions)."""
    num_transitions = batch.timesteps.numel() - 1
    for rows, cols, group in groups_of(batch.steps, num_transitions, window, jagg_frac, grouping):
        whole = rows is None or rows.numel() == batch.steps.shape[0]
        yield (batch if whole else batch.subset(rows)), cols, group


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


def make_policy_update(config=None, **settings):
    """The JAGG replacement for dancegrpo.algo.grpo.policy_update, configured by a JaggConfig (or
    its settings by name). With monitor_every N > 0 the live fidelity monitor (jagg_patch.monitor)
    measures at step 1 and every N steps (the update's `monitor`); jagg_frac "auto" routes the
    positions whose monitored cosine reaches min_cos (jagg_patch.routing; the update's `routing`)."""
    config = as_config(config, **settings)
    monitor = (Monitor(config.monitor_every, config.monitor_samples, config.alpha, resolve_backward(config.backward))
               if config.monitor_every else None)
    routing = AutoRouting(config.min_cos) if config.auto else None

    def every_group(one):
        for sub, cols, group in batch_groups(one, config.window, 1.0, config.grouping):
            yield group.index, sub, cols

    def routed_groups(batch):
        if routing is None:
            yield from batch_groups(batch, config.window, config.jagg_frac, config.grouping)
            return
        for sub, cols, group in batch_groups(batch, config.window, 1.0, config.grouping):
            yield sub, cols, dataclasses.replace(group, jagg=group.jagg and routing.routes(group.index))

    restored, layout = {}, {}   # a checkpoint's routing, applied at the first batch, once its layout is known

    def policy_update(batch):
        stats = UpdateStats()
        if routing is not None:
            if "state" in restored:
                _restore_routing(routing, monitor, restored.pop("state"), _layout(config, batch))
            layout.update(_layout(config, batch))
        if monitor is not None and monitor.due(batch):   # before the update: its gradient stays the run's own
            measured, complete = monitor.measure(batch, every_group, group_backward)
            stats.metrics.update(measured)
            if complete and routing is not None and routing.update(measured):
                print_on_rank0(f"step {batch.step}: {routing.describe()}")
        if routing is not None:
            stats.metrics["jagg_routed"] = sum(1 << p for p in routing.routed)   # bit p: position p runs JAGG
        for sub, cols, group in routed_groups(batch):   # cols: [m, w] transitions
            group_mode = config.mode if group.jagg else "exact"
            result = group_backward(sub, cols, group_mode, config.alpha, resolve_backward(config.backward),
                                    sub.backward, rollout_reuse(sub, cols, config.reuse))
            _add_group(stats, result, group_mode, cols.shape[0])
        return stats

    policy_update.jagg_config = config
    policy_update.monitor, policy_update.routing = monitor, routing
    policy_update.uses_rollout_outputs = config.uses_rollout_outputs
    if routing is not None:
        # What the update carries across steps, saved with each checkpoint (dancegrpo.algo.grpo.update_state):
        # the routing alone; the monitor's cadence follows the step number.
        # With the groups' layout, which the routed positions index: a resume with another window,
        # grouping or number of trained transitions starts its routing afresh.
        policy_update.state_dict = lambda: {"routing": routing.state_dict(), "layout": dict(layout)}
        policy_update.load_state_dict = lambda state: restored.update(state=state)
    return policy_update


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
