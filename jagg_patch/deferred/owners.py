"""Who owns the rollout rows that several trajectories share: samples that start from one latent
(--init_same_noise, DanceGRPO SD's latent per epoch, a guided call's unconditional rows at the first
step) have one key for their first step, so the rollout record cannot say whose an update row of that
key is. The flush's own rows decide it where that leaves nothing to guess:

- every loop this package reaches trains all of a sample's steps within one accumulation, and every
  sample the same number N of them; so, the other rows placed, the trajectories that share a key and
  hold N - 1 rows of the flush are the ones that trained the shared step: as many as the key has rows;
- the shared step is below every other row of each such trajectory: its first member, whose alpha is 0,
  its whole signal folded onto the group's first endpoint, which is this same input in every one of
  them (and the group's alphas are read from this same timestep). So which of them gets which of the
  identical rows does not change the gradient: they are handed out in order.

Accepted only where exactly one common count N makes every key's rows match its short trajectories one
for one, every other trajectory of the flush holds N rows, and no trajectory shares two keys; otherwise
no row is placed here (they train exactly, rows of one input in one replay of their summed signal).
"""
from collections import Counter

from .record import IDENTICAL


def _owners(n, shared, candidates, counts):
    """{key: the candidate entries short of n by one}, or None where a key's rows do not match them."""
    owners = {}
    for key, rows in shared.items():
        short = [e for e in candidates[key] if counts[e.trajectory] == n - 1]
        if len(short) != len(rows):
            return None
        owners[key] = sorted(short, key=lambda e: e.trajectory)
    return owners


def _consistent(n, owners, counts, lowest):
    """Every trajectory of the flush holds n rows with its share, and each share is its lowest step."""
    owning = {e.trajectory: e.position for entries in owners.values() for e in entries}
    if any(counts[t] + (t in owning) != n for t in set(counts) | set(owning)):
        return False
    return all(position < lowest.get(t, float("inf")) for t, position in owning.items())


def place_shared_rows(rows, candidates_of):
    """Give the rows left unplaced as identical (reason IDENTICAL) the entry of their owner where the
    flush decides it (the module); returns how many were placed. candidates_of(key): the rollout's
    entries of that key."""
    shared = {}
    counts, lowest = Counter(), {}
    for row in rows:
        if row.entry is not None:
            counts[row.entry.trajectory] += 1
            lowest[row.entry.trajectory] = min(lowest.get(row.entry.trajectory, float("inf")), row.entry.position)
        elif row.reason == IDENTICAL:
            shared.setdefault(row.key, []).append(row)
    if not shared:
        return 0
    candidates = {key: candidates_of(key) for key in shared}
    trajectories = [e.trajectory for entries in candidates.values() for e in entries]
    if len(trajectories) != len(set(trajectories)) or any(len({e.position for e in entries}) != 1
                                                          for entries in candidates.values()):
        return 0
    top = max(counts.values(), default=0)
    decided = [owners for n in (top, top + 1)
               for owners in [_owners(n, shared, candidates, counts)]
               if owners is not None and _consistent(n, owners, counts, lowest)]
    if len(decided) != 1:
        return 0
    for key, entries in decided[0].items():
        for row, entry in zip(shared[key], entries):
            row.entry, row.reason = entry, None
    return sum(len(rows) for rows in shared.values())
