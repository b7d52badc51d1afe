"""Where the deferred proxy meets the loop's gradient code. A pending row holds gradient that the
parameters' .grad does not have yet; every way a loop reads, clears or routes that gradient meets
one of the process-wide patches below while a proxy lives, so that it sees vanilla's gradient:

- reading a parameter's .grad (a clip however it was bound: imported before the proxy existed, a
  model's own method on its class or its instance, torch's two-step get_total_norm +
  clip_grads_with_norm_; a logged grad norm, a NaN check, a GradScaler's unscale_, an optimizer's
  step) or writing / deleting it: the proxies whose pending rows write to that parameter flush
  first. One property on the parameters' class (torch's Parameter, and DTensor for FSDP2's);
- zero_grad of any module or optimizer whose parameters cover everything a proxy's pending rows
  write to: those rows are dropped, as vanilla's accumulated gradient is (covering a part: its reads
  flush first, then it zeroes its part);
- backward(inputs=...) naming every parameter the pending rows write to: the pending outputs are
  added to inputs (they carry that gradient until the flush); naming a part of them while the graph
  reaches a pending output, and torch.autograd.grad of such parameters through one: refused in one
  line (the deferred gradient lands in .grad at the flush, not in what autograd returns);
- every torch optimizer's step (torch's global step hooks): the proxies that own its parameters
  flush first, on every rank alike, and the rollout's outputs are stale after it.

Installed with the first live proxy and removed with the last: at close(), or by a weak finaliser
when a proxy is dropped without it.
"""
import contextlib
import functools
import weakref

import torch

from .errors import DeferredError

_LIVE = {}        # id(proxy) -> weak reference: the live proxies
_ARMED = {}       # id(proxy) -> weak reference: the live proxies with rows pending
_CALLING = [0]    # calls the proxies are making of their models right now (not the loop's own)
_INSTALLED = []   # (owner, name, original or _ABSENT), in the order installed
_HANDLES = []     # torch's global optimizer step hooks
_ABSENT = object()
_GRAD = torch._C.TensorBase.grad   # the C attribute every tensor class inherits


@contextlib.contextmanager
def own_calls():
    """The proxies' own calls of a model (call-time forwards, replays): not the loop's reads, not
    recorded again by a forward hook."""
    _CALLING[0] += 1
    try:
        yield
    finally:
        _CALLING[0] -= 1


def calling():
    return _CALLING[0] > 0


def _proxies(table):
    return [p for p in (ref() for ref in list(table.values())) if p is not None]


def arm(proxy):
    """`proxy` has rows pending: reads of what they write to flush it first."""
    _ARMED[id(proxy)] = weakref.ref(proxy)


def disarm(proxy):
    _ARMED.pop(id(proxy), None)


# ---------------------------------------------------------------- .grad

def _flush_writers(param):
    """Flush every proxy whose pending rows write to `param`."""
    if _ARMED and not _CALLING[0]:
        for proxy in _proxies(_ARMED):
            if proxy.writes_to(param):
                proxy.flush()


def _get_grad(param):
    _flush_writers(param)
    return _GRAD.__get__(param)


def _set_grad(param, value):
    _flush_writers(param)
    _GRAD.__set__(param, value)


def _del_grad(param):
    _flush_writers(param)
    _GRAD.__delete__(param)


_GRAD_PROPERTY = property(_get_grad, _set_grad, _del_grad, doc=_GRAD.__doc__)


def parameter_class(param):
    """The class whose .grad the property goes on: torch's Parameter (its subclasses, FSDP1's
    FlatParameter, inherit it), else the parameter's own (FSDP2's DTensor: a DTensor marked a
    parameter, not a Parameter)."""
    return torch.nn.Parameter if torch.nn.Parameter in type(param).__mro__ else type(param)


# ---------------------------------------------------------------- zero_grad

def _drop_covered(params):
    """Drop the pending rows of every proxy whose rows write only to `params()`."""
    if not _ARMED or _CALLING[0]:
        return
    ids = {id(p) for p in params()}
    for proxy in _proxies(_ARMED):
        if proxy.pending_writes() <= ids:
            proxy.drop_pending()


def _optimizer_params(optimizer):
    return [p for group in getattr(optimizer, "param_groups", ()) for p in group["params"]]


def _dropping(original, params_of):
    @functools.wraps(original)
    def zero_grad(self, *args, **kwargs):
        _drop_covered(lambda: params_of(self))
        return original(self, *args, **kwargs)
    return zero_grad


# ---------------------------------------------------------------- backward(inputs=), autograd.grad

def _reaches(tensors, leaves):
    """Whether the graph of `tensors` reaches any of `leaves` (their AccumulateGrad nodes)."""
    targets = {id(leaf) for leaf in leaves}
    stack = [t.grad_fn for t in tensors if torch.is_tensor(t)]
    if any(torch.is_tensor(t) and id(t) in targets for t in tensors):
        return True
    seen, alive = set(), []   # the visited nodes kept alive: a node's Python object may be made anew on each
    while stack:              # access and a freed one's id reused, so an id alone would skip a live node
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        alive.append(node)
        if id(getattr(node, "variable", None)) in targets:
            return True
        stack.extend(next_node for next_node, _ in node.next_functions)
    return False


def _as_list(value):
    if value is None:
        return []
    return [value] if torch.is_tensor(value) or not isinstance(value, (list, tuple)) else list(value)


def with_pending_outputs(tensors, inputs):
    """backward(tensors, inputs=inputs) as the deferred proxies need it: see the module."""
    tensors, inputs = _as_list(tensors), _as_list(inputs)
    ids = {id(t) for t in inputs}
    extra = []
    for proxy in _proxies(_ARMED):
        writes = proxy.pending_writes()
        named = writes & ids
        if not named:
            continue   # none of them gets this backward's gradient, as in vanilla: the pending outputs neither
        leaves = proxy.pending_leaves()
        if named == writes:
            extra += [leaf for leaf in leaves if id(leaf) not in ids]
        elif _reaches(tensors, leaves):
            raise DeferredError(f"jagg_patch.deferred: backward(inputs=...) names {len(named)} of the {len(writes)} "
                                "parameters a deferred call's output trains: the replay gives its gradient to all of "
                                "them; name all of them (or none), or call the model without the proxy there")
    return inputs + extra


def _backward_patch(original):
    @functools.wraps(original)
    def backward(tensors, *args, **kwargs):
        if _ARMED and not _CALLING[0]:
            if "inputs" in kwargs and kwargs["inputs"] is not None:
                kwargs["inputs"] = with_pending_outputs(tensors, kwargs["inputs"])
            elif len(args) >= 5 and args[4] is not None:   # positional, after grad_tensors .. grad_variables
                args = (*args[:4], with_pending_outputs(tensors, args[4]), *args[5:])
        return original(tensors, *args, **kwargs)
    return backward


def refuse_grad_through_pending(outputs, inputs):
    """torch.autograd.grad of parameters a pending row writes to, through a pending output: refused."""
    inputs = _as_list(inputs)
    ids = {id(t) for t in inputs}
    for proxy in _proxies(_ARMED):
        if proxy.pending_writes() & ids and _reaches(_as_list(outputs), proxy.pending_leaves()):
            raise DeferredError("jagg_patch.deferred: torch.autograd.grad of the model's parameters through a deferred "
                                "call's output: the proxy gives them their gradient at the flush, into .grad, so "
                                "autograd.grad would return none of it; use backward() and read .grad, or call the "
                                "model without the proxy for this computation")


def _grad_patch(original):
    @functools.wraps(original)
    def grad(outputs, inputs, *args, **kwargs):
        if _ARMED and not _CALLING[0]:
            refuse_grad_through_pending(outputs, inputs)
        return original(outputs, inputs, *args, **kwargs)
    return grad


# ---------------------------------------------------------------- optimizer steps

def _owners_of(optimizer):
    ids = {id(p) for p in _optimizer_params(optimizer)}
    return [proxy for proxy in _proxies(_LIVE) if proxy.owns_any(ids)] if ids else []


def _before_step(optimizer, args, kwargs):
    for proxy in _owners_of(optimizer):
        proxy.flush()


def _after_step(optimizer, args, kwargs):
    for proxy in _owners_of(optimizer):
        proxy.note_step()


# ---------------------------------------------------------------- installing and removing

def _patch(owner, name, value):
    _INSTALLED.append((owner, name, owner.__dict__.get(name, _ABSENT)))
    setattr(owner, name, value)


def _install_once():
    import torch.optim.optimizer as optim
    _patch(torch.nn.Module, "zero_grad", _dropping(torch.nn.Module.zero_grad, lambda m: m.parameters()))
    _patch(torch.optim.Optimizer, "zero_grad", _dropping(torch.optim.Optimizer.zero_grad, _optimizer_params))
    _patch(torch.autograd, "backward", _backward_patch(torch.autograd.backward))
    _patch(torch.autograd, "grad", _grad_patch(torch.autograd.grad))
    _HANDLES.extend([optim.register_optimizer_step_pre_hook(_before_step),
                     optim.register_optimizer_step_post_hook(_after_step)])


def _install_grad_property(classes):
    done = {owner for owner, name, _ in _INSTALLED if name == "grad" and isinstance(owner, type)}
    for cls in classes:
        if cls not in done and not any(issubclass(cls, d) for d in done) and cls is not torch.Tensor:
            _patch(cls, "grad", _GRAD_PROPERTY)
            done.add(cls)


def _uninstall():
    for owner, name, original in reversed(_INSTALLED):
        if original is _ABSENT:
            delattr(owner, name)
        else:
            setattr(owner, name, original)
    _INSTALLED.clear()
    for handle in _HANDLES:
        handle.remove()
    _HANDLES.clear()


def installed():
    """What is patched now: [(owner, attribute)] (empty once no proxy lives)."""
    return [(owner, name) for owner, name, _ in _INSTALLED]


def register(proxy, params):
    """A live proxy of a model with `params`: the patches installed with the first; removed with the
    last (unregister, run by close() or when the proxy is collected). Returns the finaliser."""
    if not _LIVE:
        _install_once()
    watch(params)
    _LIVE[id(proxy)] = weakref.ref(proxy)
    return weakref.finalize(proxy, unregister, id(proxy))


def watch(params):
    """The .grad property on the classes of `params` (a model given parameters of a new class)."""
    if _LIVE or _INSTALLED:
        _install_grad_property({parameter_class(p) for p in params})


def unregister(key):
    _LIVE.pop(key, None)
    _ARMED.pop(key, None)
    if not _LIVE and (_INSTALLED or _HANDLES):
        _uninstall()


def real_optimizer(optimizer):
    """The torch optimizer that steps the parameters: the innermost of a wrapper's .optimizer chain
    (accelerate's AcceleratedOptimizer subclasses torch's Optimizer without running its __init__; the
    optimizer it holds is the one that steps, on sync steps only)."""
    seen = set()
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer) and id(optimizer) not in seen:
        seen.add(id(optimizer))
        optimizer = optimizer.optimizer
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise DeferredError(f"jagg_patch.deferred: {type(optimizer).__name__} is no torch optimizer and holds none as "
                            ".optimizer; attach the torch.optim.Optimizer that steps the model's parameters")
    return optimizer
