"""What one flush did, counted in rows (one row = one sample's pass through the model at one step)."""
from dataclasses import dataclass, field, fields

import torch

from .record import REASONS

# Fields that are the largest over flushes (and ranks), not a sum.
LARGEST = ("max_replay_diff", "replay_bound", "time_s")


@dataclass
class FlushStats:
    calls: int = 0              # the loop's calls in grad mode since the last flush
    rows_deferred: int = 0      # their rows
    rows_dropped: int = 0       # rows of calls before a zero_grad that erased them (as it erases vanilla's gradient)
    rollout_rows: int = 0       # rows of calls without grad recorded as rollout steps
    shared_placed: int = 0      # rows several rollout rows share, placed by the flush's counts (deferred.owners)
    forwards_nograd: int = 0    # rows forwarded without grad when the loop called
    forwards_reused: int = 0    # rows whose call-time output was the rollout's own
    rows_exact: dict = field(default_factory=dict)   # why -> rows trained exactly (their own forward and backward)
    jagg_groups: int = 0        # groups whose signals were folded onto their two endpoints
    exact_groups: int = 0       # groups routed exact, and every row trained exactly for another reason
    endpoint_rows: int = 0      # endpoint rows replayed with a folded signal
    zero_rows: int = 0          # rows (or endpoints) not replayed: their signal is zero
    forwards_grad: int = 0      # rows replayed with grad, padding included
    backward_calls: int = 0     # replayed chunks: one forward with grad and one backward each
    padding_rows: int = 0       # zero rows run so that every rank runs the same collectives
    max_replay_diff: float = 0.0   # the largest |replay - call-time output| over the replayed rows
    replay_bound: float = 0.0      # the bound it was held to (the largest of the chunks')
    time_s: float = 0.0

    @property
    def exact_rows(self):
        return sum(self.rows_exact.values())

    def as_dict(self, prefix="deferred_"):
        """A flat record (for a metrics line): the counts, and exact rows per reason (every reason, so
        that every rank's record has the same fields)."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, dict):
                out[f"{prefix}exact_rows"] = self.exact_rows
                out.update({f"{prefix}exact/{why.replace(' ', '_')}": value.get(why, 0) for why in REASONS})
            else:
                out[f"{prefix}{f.name}"] = value
        return out

    @classmethod
    def total(cls, many):
        """The flushes of a step (or a run) summed; the replay difference and bound are the largest."""
        total = cls()
        for one in many:
            for f in fields(cls):
                value, mine = getattr(one, f.name), getattr(total, f.name)
                if isinstance(value, dict):
                    for why, n in value.items():
                        mine[why] = mine.get(why, 0) + n
                elif f.name in LARGEST:
                    setattr(total, f.name, max(mine, value))
                else:
                    setattr(total, f.name, mine + value)
        return total


def over_ranks(record, device):
    """The step's counts summed over the ranks (the largest for the replay difference, bound, time)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return record
    names = sorted(record)
    largest = [n for n in names if n.split("deferred_")[-1] in LARGEST]
    summed = [n for n in names if n not in largest]
    for group, op in ((summed, dist.ReduceOp.SUM), (largest, dist.ReduceOp.MAX)):
        if group:
            t = torch.tensor([float(record[n]) for n in group], dtype=torch.float64, device=device)
            dist.all_reduce(t, op=op)
            record.update({n: (int(v) if isinstance(record[n], int) else v) for n, v in zip(group, t.tolist())})
    return record


def flush_record(stats, device):
    """The fields a metrics record gets from these flushes (a step's, or one flush's): deferred_* counts, and the record's
    own jagg_groups / exact_groups / transformer_forwards_reused as the deferred update ran them."""
    total = FlushStats.total(stats)
    record = {**total.as_dict(), "jagg_groups": total.jagg_groups, "exact_groups": total.exact_groups,
              "transformer_forwards_reused": total.forwards_reused}
    return over_ranks(record, device)


def summary(records):
    """One line for a run's flushes: `records` are flush_record()'s (summed over the ranks). Vanilla runs
    one backward per call the loop makes in grad mode, of the call's rows; the deferred update runs the
    replayed chunks' backwards."""
    total = {}
    for record in records:
        for name, value in record.items():
            if name.startswith("deferred_") and not name.endswith(LARGEST):
                total[name] = total.get(name, 0) + value

    def get(name):
        return int(total.get(f"deferred_{name}", 0))

    exact = [(why, get(f"exact/{why.replace(' ', '_')}")) for why in REASONS]
    exact_text = ", ".join(f"{why} {n}" for why, n in exact if n) or "none"
    calls, backwards, rows, replayed = get("calls"), get("backward_calls"), get("rows_deferred"), get("forwards_grad")
    saved = f"{calls - backwards} backwards saved ({backwards} for vanilla's {calls})" if calls else "no backward"
    flushes = f"{len(records)} flush{'' if len(records) == 1 else 'es'}"
    return (f"jagg_patch.deferred: {flushes}, {rows} rows deferred in {calls} calls; trained exactly: {exact_text}; "
            f"{replayed} rows replayed with grad in {backwards} backwards, where vanilla backpropagates "
            f"{rows} rows in {calls}: {saved}" + (f"; {get('rows_dropped')} rows dropped by zero_grad"
                                                  if get("rows_dropped") else ""))
