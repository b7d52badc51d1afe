"""The rollout record: the calls without grad that form trajectories, and where a row of the update
sits in them.

A rollout calls the model once per denoising step on the same rows in the same order, so its calls
form chains: a call continues the open chain with the same row count and the same per-row
conditioning whose timesteps it moves on, in the chain's direction, and whose latents it changed.
Each row of a chain is one trajectory (a guided call's conditional and unconditional rows are two),
and its place in the chain is its position. An update row is placed by its key (calls.Call.keys):
one matching rollout row places it there; none ("no rollout record") or several ("identical rows":
samples that start from one latent, a group sharing its prompt) leave it to be trained exactly, as
does a call that could continue more than one chain (its chains end there and it starts its own,
so interleaved rollouts are never linked across each other).

A call whose rows are all known already (a re-evaluation of the rollout's rows: old log-probs
recomputed, a reference pass) only joins the record when its chain goes on to rows not known (a
second batch that starts from the first batch's latent); a chain of known rows alone is left out.
Calls without grad during the update whose rows are all known (a KL reference pass) are not a
rollout; the first call with a new row after the update has begun starts the next rollout and drops
the old record.
"""
from dataclasses import dataclass, field

import torch

NO_RECORD = "no rollout record"
IDENTICAL = "identical rows"
TRAINED_TWICE = "trained twice"
ROUTED_EXACT = "routed exact"
MODE_EXACT = "mode exact"
FROZEN = "requires_grad changed"   # a group whose rows were called with different parameters trainable
PARTIAL_WINDOW = "window not trained whole"   # the window grouping: a window the loop trained only part of
REASONS = (NO_RECORD, IDENTICAL, TRAINED_TWICE, ROUTED_EXACT, MODE_EXACT, FROZEN, PARTIAL_WINDOW)


@dataclass
class Entry:
    """One rollout row: its trajectory and position, and (for reuse) its output and what it ran under."""
    trajectory: int
    position: int
    output: torch.Tensor = None
    context: tuple = None


@dataclass
class Chain:
    trajectories: list
    conds: list          # per row: the key without the latent and the timestep
    last_t: list
    last_latents: list
    direction: int = 0   # +1 / -1 once two calls set it
    closed: bool = False
    length: int = 0      # calls so far: the next call's position
    confirmed: bool = False   # a call of it held a row not known before: its entries are in the index
    tentative: list = field(default_factory=list)   # (key, Entry) of its calls while it is not confirmed

    def continued_by(self, call):
        if self.closed or len(self.trajectories) != call.rows:
            return False
        step = [t - last for t, last in zip(call.t.tolist(), self.last_t)]
        if any(s == 0 for s in step):
            return False
        signs = {1 if s > 0 else -1 for s in step}
        if len(signs) != 1 or (self.direction and signs != {self.direction}):
            return False
        return all(_cond(key) == cond and _latent(key) != last
                   for key, cond, last in zip(call.keys, self.conds, self.last_latents))


def _latent(key):
    return key[0][0]


def _cond(key):
    return key[0][1:], key[2]


def reuse_context(call, r):
    """What a rollout output must have run under to stand for the update's own output of row r: the
    autocast, and the latent's dtype."""
    return call.autocast, call.arguments[call.shape.roles.latent].dtype


@dataclass
class RolloutRecord:
    keep_outputs: bool = False
    chains: list = field(default_factory=list)
    index: dict = field(default_factory=dict)   # key -> [Entry]
    in_update: bool = False
    stale: bool = False   # an optimizer step since the rollout: its outputs are not the model's now
    next_trajectory: int = 0

    def clear(self):
        self.chains, self.index, self.stale = [], {}, False

    def observe(self, call, output, pending_keys):
        """A call without grad: recorded as a rollout step, or skipped as a re-evaluation of rows the
        update knows. Returns whether it was recorded."""
        if self.in_update:
            if all(key in self.index or key in pending_keys for key in call.keys):
                return False
            self.clear()
            self.in_update = False
        new = any(key not in self.index for key in call.keys)
        chain = self._chain_for(call)
        position = chain.length
        entries = []
        for r, key in enumerate(call.keys):
            kept = output[r] if self.keep_outputs and output is not None else None
            entries.append((key, Entry(chain.trajectories[r], position, kept,
                                       reuse_context(call, r) if kept is not None else None)))
        if new or chain.confirmed:
            chain.confirmed = True
            for key, entry in chain.tentative + entries:
                self.index.setdefault(key, []).append(entry)
            chain.tentative = []
        else:
            chain.tentative += entries
        chain.last_t = call.t.tolist()
        chain.last_latents = [_latent(key) for key in call.keys]
        chain.length = position + 1
        return True

    def _chain_for(self, call):
        candidates = [c for c in self.chains if c.continued_by(call)]
        if len(candidates) == 1:
            chain = candidates[0]
            step = float(call.t[0]) - chain.last_t[0]
            chain.direction = 1 if step > 0 else -1
            return chain
        for c in candidates:   # several chains it could continue: none is continued
            c.closed = True
        chain = Chain(list(range(self.next_trajectory, self.next_trajectory + call.rows)),
                      [_cond(key) for key in call.keys], [], [])
        self.next_trajectory += call.rows
        self.chains.append(chain)
        return chain

    def candidates(self, key):
        """The rollout's entries of `key` (several where trajectories share it)."""
        return list(self.index.get(key, ()))

    def place(self, key):
        """(the Entry of the one rollout row with this key, None) or (None, why it has none)."""
        entries = self.index.get(key)
        if not entries:
            return None, NO_RECORD
        if len(entries) > 1:
            return None, IDENTICAL
        return entries[0], None
