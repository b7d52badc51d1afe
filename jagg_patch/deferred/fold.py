"""What a flush replays: the pending rows grouped by trajectory, in denoising order (their position
in the rollout), cut into groups of W trained rows and routed by jagg_frac as the restated update
routes them (jagg_patch.plan); each JAGG group's signals folded onto its two endpoints
(jagg_patch.core), every other row with its own signal. Rows that could not be placed, rows of a
trajectory trained twice in one flush, rows of exact groups and rows of a group whose calls had
different parameters trainable (one frozen between them: no endpoint stands for both) are trained
exactly. Rows several trajectories share are placed first where the flush decides their owners
(jagg_patch.deferred.owners); those left unplaced train exactly, the rows of one input (one key, alike
calls) in one replay of their summed signal: one forward and one backward for all of them."""
from dataclasses import dataclass

import torch

from ..core import endpoint_weights, fold_signals, interpolation_weights
from ..plan import plan_groups, plan_windows
from .owners import place_shared_rows
from .record import FROZEN, IDENTICAL, MODE_EXACT, PARTIAL_WINDOW, ROUTED_EXACT, TRAINED_TWICE


@dataclass
class Row:
    """One row of a pending call: where the rollout placed it (entry) or why not (reason), and the
    gradient the loop's loss sent to it."""
    call: object
    index: int
    entry: object
    reason: str

    @property
    def signal(self):
        grad = self.call.leaf.grad
        return torch.zeros_like(self.call.output[self.index]) if grad is None else grad[self.index]

    @property
    def t(self):
        return float(self.call.t[self.index])

    @property
    def key(self):
        return self.call.keys[self.index]


@dataclass
class Replay:
    """A row to run again with grad, the gradient its output gets, and whether it is a JAGG group's
    endpoint (else a row trained exactly)."""
    call: object
    index: int
    signal: torch.Tensor
    endpoint: bool = False


def pending_rows(calls):
    return [Row(call, r, *call.placements[r]) for call in calls for r in range(call.rows)]


def _by_trajectory(rows, config, exact):
    trajectories = {}
    for row in rows:
        if config.mode == "exact":
            exact.append((row, MODE_EXACT))
        elif row.entry is None:
            exact.append((row, row.reason))
        else:
            trajectories.setdefault(row.entry.trajectory, []).append(row)
    return trajectories


def _group_replays(groups, config, stats):
    """The two endpoint replays of each JAGG group (its members in denoising order). Groups of one
    width (and output form) are folded together, member j of every group in one tensor: the same
    arithmetic per element as one group at a time (jagg_patch.core folds a micro-batch's groups so),
    in a few tensor ops."""
    alike, replays = {}, []
    for members in groups:
        output = members[0].call.output
        alike.setdefault((len(members), output.dtype, output.device, tuple(output.shape[1:])), []).append(members)
    for (width, *_), batch in alike.items():
        t = torch.tensor([[m.t for m in members] for members in batch], dtype=torch.float64).T   # [W, groups]
        weights = endpoint_weights(interpolation_weights(t, config.alpha), config.mode, width)
        signals = {j: torch.stack([members[j].signal for members in batch]) for j in range(width)}
        for end, at in ((0, 0), (1, -1)):
            folded = fold_signals(weights, signals, end)
            replays += [Replay(members[at].call, members[at].index, folded[g], True) for g, members in enumerate(batch)]
    stats.jagg_groups += len(groups)
    return replays


def _one_replay_per_input(exact):
    """The exact replays, the rows left unplaced as identical merged by input: one row of each input
    (its key, its call's shared arguments, autocast, mode and trainable parameters) with their signals
    summed (the rows' outputs are one function of one input, so the sum of their gradients is one
    backward of the summed signal)."""
    replays, merged = [], {}
    for row, why in exact:
        if why != IDENTICAL:
            replays.append(Replay(row.call, row.index, row.signal))
            continue
        input_key = (row.key, row.call.shared_key(), row.call.trainable)
        if input_key in merged:
            merged[input_key].signal = merged[input_key].signal + row.signal
        else:
            merged[input_key] = Replay(row.call, row.index, row.signal)
            replays.append(merged[input_key])
    return replays


def _nonzero(replays, stats):
    """The replays whose signal is not all zero (a row the loss did not reach), read once per device
    rather than once per row (each read waits for the device); one flag per row, no copy of the signals."""
    on_device, keep = {}, [False] * len(replays)
    for i, replay in enumerate(replays):
        on_device.setdefault(replay.signal.device, []).append(i)
    for found in on_device.values():
        for i, flag in zip(found, torch.stack([replays[i].signal.ne(0).any() for i in found]).tolist()):
            keep[i] = flag
    kept = [r for r, flag in zip(replays, keep) if flag]
    stats.zero_rows += len(replays) - len(kept)
    return kept


def _cut(members, config, transitions):
    """[(its rows, routed to JAGG, why exact)] of one trajectory's rows in denoising order: W
    consecutive trained rows (the paper's grouping), or the trajectory's windows (the authors': window g
    holds positions gW .. gW+W-1 of `transitions`, routed by g as jagg_patch.plan.plan_windows routes;
    a window the loop did not train whole trains exactly)."""
    if config.grouping != "window":
        return [([members[i] for i in group.members], group.jagg, ROUTED_EXACT)
                for group in plan_groups(range(len(members)), config.window, config.jagg_frac)]
    windows = plan_windows(transitions, config.window, config.jagg_frac)
    by_window = {}
    for m in members:
        by_window.setdefault(m.entry.position // config.window, []).append(m)
    cut = []
    for g, rows in by_window.items():
        whole = g < len(windows) and tuple(m.entry.position for m in rows) == windows[g].members
        cut.append((rows, whole and windows[g].jagg, ROUTED_EXACT if whole else PARTIAL_WINDOW))
    return cut


def plan_replay(rows, config, stats, candidates_of=None, transitions=None):
    """The replays of one flush's rows under `config` (a JaggConfig), counted into `stats`;
    candidates_of(key): the rollout's entries of a key several rows share (their owners are decided
    from the flush's rows, jagg_patch.deferred.owners); transitions: a trajectory's trainable
    transitions, which the window grouping cuts."""
    exact, groups = [], []
    if candidates_of is not None and config.mode != "exact":
        stats.shared_placed += place_shared_rows(rows, candidates_of)
    for members in _by_trajectory(rows, config, exact).values():
        positions = [m.entry.position for m in members]
        if len(set(positions)) < len(positions):
            exact += [(m, TRAINED_TWICE) for m in members]
            continue
        members.sort(key=lambda m: m.entry.position)
        for chosen, jagg, why in _cut(members, config, transitions):
            if jagg and len({m.call.trainable for m in chosen}) > 1:
                exact += [(m, FROZEN) for m in chosen]
            elif jagg:
                groups.append(chosen)
            else:
                exact += [(m, why) for m in chosen]
                stats.exact_groups += why == ROUTED_EXACT
    for row, why in exact:
        stats.rows_exact[why] = stats.rows_exact.get(why, 0) + 1
        stats.exact_groups += why != ROUTED_EXACT   # a row of its own
    kept = _nonzero(_group_replays(groups, config, stats) + _one_replay_per_input(exact), stats)
    stats.endpoint_rows += sum(r.endpoint for r in kept)
    return kept
