"""Running a flush's replays: rows cut into chunks no larger than the loop's own calls (so the
replay's activation peak is vanilla's), or twice that under the batched backward form (both endpoints
of a call's rows in one forward: the restated batched form's peak, fewer and larger passes), each
chunk one forward with grad under the autocast and train / eval mode its rows were called in,
checked against the call-time output, and one backward of the chunk's signals; and how each engine
runs them so that no rank waits for another:

- one process: the chunks as they are;
- DDP (the proxy outside it): every chunk but the last through the inner module (no DDP hooks: as
  under no_sync), the last through DDP with its gradient sync on, so every rank runs exactly one
  synced backward per flush (a zero row where a rank has nothing to replay);
- FSDP1 / FSDP2: every forward and backward gathers and reduces, so every rank runs as many chunks
  as the rank with the most (zero rows pad the others).
"""
import contextlib
from dataclasses import dataclass

import torch

from .calls import gather_rows
from .errors import DeferredError

# The largest |replay - call-time output| allowed, relative to the call-time output's largest value,
# by the precision the rows were computed in (the autocast dtype where it was on). A replay in another
# batch than the call differs by rounding only; dropout, an argument changed in place or moved
# parameters differ by far more.
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 6.25e-2, torch.float16: 7.8e-3}


@dataclass
class Chunk:
    """Rows replayed in one forward: parts = [(call, [row indices])]; whole: the call's own arguments
    (a call whose arguments cannot be cut by row), with zero signals on the rows not replayed."""
    parts: list
    signals: torch.Tensor
    whole: bool = False

    @property
    def rows(self):
        return sum(len(rows) for _, rows in self.parts)

    def arguments(self):
        call = self.parts[0][0]
        return dict(call.arguments) if self.whole else gather_rows(self.parts)

    def expected(self):
        return torch.cat([call.output[rows] for call, rows in self.parts])


def chunk_rows(call_rows, backward):
    """The most rows one replay runs: the loop's largest call's (vanilla's activation peak) under the
    joint and split forms, twice that under batched; auto: batched on several ranks, split on one."""
    from ..settings import resolve_backward
    return call_rows * (2 if resolve_backward(backward) == "batched" else 1)


def make_chunks(replays, max_rows, calls):
    """Chunks of at most max_rows rows, rows of alike calls (calls.Call.shared_key, and the same
    parameters trainable) together, in the order of `calls` (the pending calls) and of the rows in
    each (so that a chunk takes whole runs of one call's rows: one slice each, not one per row); the
    rows of calls that cannot be cut replay their whole call."""
    order = {id(call): i for i, call in enumerate(calls)}
    whole, groups = {}, {}
    for replay in sorted(replays, key=lambda r: (order[id(r.call)], r.index)):
        if replay.call.splittable:
            groups.setdefault((replay.call.shared_key(), replay.call.trainable), []).append(replay)
        else:
            whole.setdefault(id(replay.call), []).append(replay)
    chunks = []
    for members in groups.values():
        for start in range(0, len(members), max_rows):
            chunks.append(_chunk(members[start:start + max_rows]))
    for members in whole.values():
        call = members[0].call
        signals = torch.zeros_like(call.output)
        for replay in members:
            signals[replay.index] = replay.signal.to(signals.dtype)
        chunks.append(Chunk([(call, list(range(call.rows)))], signals, whole=True))
    return chunks


def _chunk(members):
    parts = []
    for replay in members:
        if parts and parts[-1][0] is replay.call:
            parts[-1][1].append(replay.index)
        else:
            parts.append((replay.call, [replay.index]))
    dtype = members[0].call.output.dtype
    return Chunk(parts, torch.stack([r.signal.to(dtype) for r in members]))


def zero_chunk(call):
    """One row of `call` with a zero signal: a rank's share of the collectives when it has no row."""
    return Chunk([(call, [0])], torch.zeros_like(call.output[:1]))


@contextlib.contextmanager
def called_as(call, mode_module, model):
    """The autocast and train / eval mode `call` ran under, with grad on."""
    with contextlib.ExitStack() as stack:
        for device, enabled, dtype in call.autocast:
            if device == "cuda" and not torch.cuda.is_available():
                continue
            stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled) if enabled
                                else torch.autocast(device, enabled=False))
        stack.enter_context(torch.enable_grad())
        before = mode_module.training
        if before != call.training:
            model.train(call.training)
        try:
            yield
        finally:
            if mode_module.training != before:
                model.train(before)


@contextlib.contextmanager
def trainable_as(trainable, params):
    """The parameters whose ids are in `trainable` require grad, the others not, as at the rows' call
    (a parameter frozen since the call still gets its gradient, as vanilla's backward gave it then)."""
    changed = [p for p in params if p.requires_grad != (id(p) in trainable)]
    for p in changed:
        p.requires_grad_(not p.requires_grad)
    try:
        yield
    finally:
        for p in changed:
            p.requires_grad_(not p.requires_grad)


def precision(call, output):
    """The dtype the rows were computed in: the autocast's where it was on for the output's device."""
    for device, enabled, dtype in call.autocast:
        if enabled and device == output.device.type:
            return dtype
    return output.dtype


def guard(chunk, output, stats, tolerance=None):
    """Stop when the replay is not the call-time output (see TOLERANCE)."""
    expected = chunk.expected()
    if output.shape != expected.shape:
        raise DeferredError(f"the replay of a deferred call gave an output of shape {tuple(output.shape)}, the call "
                            f"gave {tuple(expected.shape)}: the model's output rows are not its input rows")
    dtype = precision(chunk.parts[0][0], output)
    scale = float(expected.detach().abs().max()) if expected.numel() else 0.0
    bound = (tolerance or TOLERANCE.get(dtype, 1e-4)) * max(scale, 1e-30)
    diff = float((output.detach() - expected.to(output.dtype)).abs().max()) if expected.numel() else 0.0
    stats.max_replay_diff = max(stats.max_replay_diff, diff)
    stats.replay_bound = max(stats.replay_bound, bound)
    if not diff <= bound:
        raise DeferredError(f"jagg_patch.deferred: the replay of a deferred call differs from its call-time output by "
                            f"{diff:.3g} (bound {bound:.3g} for {str(dtype).replace('torch.', '')}): the model's output "
                            "is not a function of its arguments alone (dropout, an argument changed in place, "
                            "parameters moved without a flush); the run stops (see docs/deferred.md)")


def _kind(model):
    from torch.nn.parallel import DistributedDataParallel
    if isinstance(model, DistributedDataParallel):
        return "ddp"
    if any(isinstance(m, fsdp_classes()) for m in model.modules()):
        return "collective"
    return "plain"


def fsdp_classes():
    """FSDP1's class and FSDP2's (torch.distributed.fsdp.FSDPModule; before torch 2.6 it lived in
    torch.distributed._composable.fsdp)."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    classes = [FullyShardedDataParallel]
    for where in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"):
        try:
            classes.append(getattr(__import__(where, fromlist=["FSDPModule"]), "FSDPModule"))
            break
        except (ImportError, AttributeError):
            continue
    return tuple(classes)


def refuse_unsupported(model):
    """One line for an engine the proxy does not drive."""
    if any(cls.__name__ == "DeepSpeedEngine" for cls in type(model).__mro__):
        raise DeferredError("jagg_patch.deferred does not drive a DeepSpeed engine (it runs every backward itself, "
                            "engine.backward(loss), and steps in engine.step()): train with DDP, FSDP1 or FSDP2, or "
                            "use the restated update (python -m jagg_patch without --jagg_deferred)")


class Replayer:
    """How the replays reach the model: `target` runs a call without grad (DDP's inner module, which
    holds no collective), `run` the chunks of one flush."""

    def __init__(self, model):
        refuse_unsupported(model)
        self.model, self.kind = model, _kind(model)
        self.target = model.module if self.kind == "ddp" else model
        self.collectives = 0   # this rank's count of the proxy's collectives: every rank must make the same

    @property
    def distributed(self):
        import torch.distributed as dist
        return self.kind != "plain" and dist.is_available() and dist.is_initialized()

    def device(self):
        param = next(self.model.parameters(), None)
        return param.device if param is not None else torch.device("cpu")

    def most(self, value):
        """`value` (an integer) maxed over the ranks where the engine is distributed. Each rank also sends
        how many of these it made: ranks that reached it from different places (a gradient read on one
        rank alone flushed there) stop in one line instead of pairing another rank's collectives."""
        if not self.distributed:
            return value
        import torch.distributed as dist
        self.collectives += 1
        t = torch.tensor([value, self.collectives, -self.collectives], dtype=torch.int64, device=self.device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if int(t[1]) != -int(t[2]):
            raise DeferredError(f"jagg_patch.deferred: the ranks flushed at different points ({-int(t[2])} and "
                                f"{int(t[1])} flushes so far): a gradient read (.grad, a clip) on some ranks only "
                                "flushes there alone; read it on every rank, or call proxy.flush() on every rank first")
        return int(t[0])

    def agreed(self, flag):
        """True on every rank only where it is true on every rank (collective engines: a call-time
        forward is a collective, so every rank decides alike whether to run it)."""
        if self.kind != "collective" or not self.distributed:
            return flag
        return not self.most(0 if flag else 1)

    def run(self, chunks, template, run_chunk, stats):
        """run_chunk(chunk, target) for each chunk, padded as the engine needs (see the module)."""
        if self.kind == "collective" and self.distributed:
            count = self.most(len(chunks))
            pads = [zero_chunk(template) for _ in range(count - len(chunks))]
            stats.padding_rows += len(pads)
            for chunk in chunks + pads:
                run_chunk(chunk, self.model)
            return
        if self.kind == "ddp" and self.distributed:
            if not chunks:
                chunks = [zero_chunk(template)]
                stats.padding_rows += 1
            for chunk in chunks[:-1]:
                run_chunk(chunk, self.target)
            synced, self.model.require_backward_grad_sync = self.model.require_backward_grad_sync, True
            try:
                run_chunk(chunks[-1], self.model)
            finally:
                self.model.require_backward_grad_sync = synced
            return
        for chunk in chunks:
            run_chunk(chunk, self.target)
