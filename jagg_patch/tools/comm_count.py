"""Counting FSDP's parameter all-gathers and gradient reduce-scatters per unit (an analysis tool
beside the patch), FSDP1's (`FullyShardedDataParallel`) and FSDP2's (`fully_shard`):
`count_collectives(model)` picks the counter the model needs.

The paper says JAGG's joint backward triggers one FSDP all-gather per module per group. FSDP1
all-gathers a unit's flat parameter in `FlatParamHandle._all_gather_flat_param` (forward:
pre-forward unshard; backward: pre-backward unshard, after the forward resharded it under
FULL_SHARD). `count_fsdp_collectives` wraps that method, and the gradient reduce-scatter, for the
duration of a `with` block and attributes each call to its unit.

Why the joint backward gathers once per unit: FSDP1 unshards a unit in its pre-backward hook at
most once per backward call (`_ran_pre_backward_hook`), and reshards it in the post-backward hook
on the flat parameter's AccumulateGrad, which autograd runs once per call, after every graph that
uses the parameter has delivered its gradient. One call through both endpoint graphs therefore
gathers each unit once and reduce-scatters its gradient once; the price is that a unit stays
unsharded from its first graph's backward until the second graph reaches it (the engine runs the
later endpoint's graph first), i.e. up to every unit at once: the whole unsharded model.

FSDP2 keeps one parameter group per `fully_shard` unit; `FSDPParamGroup.unshard` calls the module
function `foreach_all_gather` and `post_backward` calls `foreach_reduce`, looked up in the group's
module at call time, so `count_fsdp2_collectives` replaces those two names for the `with` block and
attributes each call to its group by the group's parameters; `_to_sharded` is where a group frees
its unsharded parameters. FSDP2 runs a unit's post-backward once per forward it ran (its hook sits on
each forward's inputs), so where FSDP1 gathers once per backward call, FSDP2 may gather per graph:
the counts, not this docstring, say which (docs/jagg.md has them side by side).
"""
import contextlib
from collections import Counter


def fsdp_units(model):
    """{id(FlatParamHandle): unit name} of every FSDP1 unit in `model` ("" is the root)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    names = {}
    for name, module in model.named_modules():
        if isinstance(module, FSDP) and getattr(module, "_handle", None) is not None:
            names[id(module._handle)] = name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")
    return names


class CollectiveCounts:
    """all_gathers[unit] and reduce_scatters[unit] seen inside the `with` block, and the most
    parameter bytes gathered (unsharded by an all-gather, not yet freed) at any one time. A unit is
    keyed by the id of what gathers it (FSDP1's FlatParamHandle, FSDP2's param group)."""

    def __init__(self, units):
        self.units = units
        self.all_gathers, self.reduce_scatters = Counter(), Counter()
        self.gathered, self.peak_gathered_bytes, self.peak_gathered_units = {}, 0, 0

    def on_gather(self, key, tensor):
        self.all_gathers[key] += 1
        self.gathered[key] = tensor.numel() * tensor.element_size()
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, sum(self.gathered.values()))
        self.peak_gathered_units = max(self.peak_gathered_units, len(self.gathered))

    def on_free(self, key):
        self.gathered.pop(key, None)

    def per_unit(self):
        return {self.units.get(h, "?"): n for h, n in self.all_gathers.items()}

    def total_all_gathers(self):
        return sum(self.all_gathers.values())

    def total_reduce_scatters(self):
        return sum(self.reduce_scatters.values())


@contextlib.contextmanager
def count_fsdp_collectives(model):
    """Count FSDP1's parameter all-gathers and gradient reduce-scatters per unit of `model`."""
    from torch.distributed.fsdp import _runtime_utils
    from torch.distributed.fsdp._flat_param import FlatParamHandle
    counts = CollectiveCounts(fsdp_units(model))
    all_gather, reduce_grad = FlatParamHandle._all_gather_flat_param, _runtime_utils._reduce_grad
    free = FlatParamHandle._free_unsharded_flat_param

    def counted_all_gather(handle, *args, **kwargs):
        out = all_gather(handle, *args, **kwargs)
        counts.on_gather(id(handle), out)
        return out

    def counted_free(handle, *args, **kwargs):
        counts.on_free(id(handle))
        return free(handle, *args, **kwargs)

    def counted_reduce(state, handle):
        if handle.uses_sharded_strategy:
            counts.reduce_scatters[id(handle)] += 1
        return reduce_grad(state, handle)

    FlatParamHandle._all_gather_flat_param = counted_all_gather
    FlatParamHandle._free_unsharded_flat_param = counted_free
    _runtime_utils._reduce_grad = counted_reduce
    try:
        yield counts
    finally:
        FlatParamHandle._all_gather_flat_param = all_gather
        FlatParamHandle._free_unsharded_flat_param = free
        _runtime_utils._reduce_grad = reduce_grad


def fsdp2_units(model):
    """{id(FSDPParamGroup): unit name} of every fully_shard unit of `model` ("" is the root), and
    {id(FSDPParam): id(its group)}."""
    from torch.distributed.fsdp import FSDPModule
    names, params = {}, {}
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        if group is not None:
            names[id(group)] = name.replace("_checkpoint_wrapped_module.", "")
            params.update({id(p): id(group) for p in group.fsdp_params})
    return names, params


@contextlib.contextmanager
def count_fsdp2_collectives(model):
    """Count FSDP2's parameter all-gathers and gradient reduce-scatters per unit of `model`."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as groups
    names, params = fsdp2_units(model)
    counts = CollectiveCounts(names)
    all_gather, reduce, to_sharded = groups.foreach_all_gather, groups.foreach_reduce, groups.FSDPParamGroup._to_sharded

    def counted_all_gather(fsdp_params, *args, **kwargs):
        result = all_gather(fsdp_params, *args, **kwargs)
        counts.on_gather(params.get(id(fsdp_params[0])) if fsdp_params else None, result.all_gather_output)
        return result

    def counted_reduce(fsdp_params, *args, **kwargs):
        counts.reduce_scatters[params.get(id(fsdp_params[0])) if fsdp_params else None] += 1
        return reduce(fsdp_params, *args, **kwargs)

    def counted_to_sharded(group, *args, **kwargs):
        counts.on_free(id(group))
        return to_sharded(group, *args, **kwargs)

    groups.foreach_all_gather, groups.foreach_reduce = counted_all_gather, counted_reduce
    groups.FSDPParamGroup._to_sharded = counted_to_sharded
    try:
        yield counts
    finally:
        groups.foreach_all_gather, groups.foreach_reduce = all_gather, reduce
        groups.FSDPParamGroup._to_sharded = to_sharded


def count_collectives(model):
    """The counter for `model`: FSDP2's for a fully_shard model, FSDP1's otherwise."""
    from torch.distributed.fsdp import FSDPModule
    if isinstance(model, FSDPModule):
        return count_fsdp2_collectives(model)
    return count_fsdp_collectives(model)


__all__ = ["count_collectives", "count_fsdp_collectives", "count_fsdp2_collectives", "fsdp_units", "fsdp2_units",
           "CollectiveCounts"]
