"""One model call as the deferred proxy sees it: its arguments bound to the model's `forward` by
name (so positional and keyword calls are the same call), which arguments hold one row per sample
and which are shared by the rows, the timestep each row gets, each row's key, and how the model's
output is rebuilt around another tensor.

A row's key is what places it in a rollout trajectory: the exact values of its latent, its
timestep and its other per-row arguments, whatever their form (a 0-d or a [B] timestep, a
keyword or a positional argument, a dtype cast of the same values). Shared arguments (Flux's
img_ids / txt_ids, flags) are not part of it.

Which arguments are shared cannot always be told from shapes (Flux's txt_ids is [T, 3] for every
row, and T can equal the batch): ARGUMENT_ROLES says it per model class; for a class it does not
list, a tensor whose first dimension is the batch is taken as per-row. A call holding an argument
whose rows cannot be cut apart (a container of tensors) is replayed whole.
"""
import dataclasses
import inspect
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from .errors import DeferredError


@dataclass(frozen=True)
class ArgumentRoles:
    """latent: the argument holding the noisy latents (one row per sample); timestep: the argument
    the alpha rules read, as the model receives it; shared: arguments never cut by row, whatever
    their shape; per_row: lists holding one item per row."""
    latent: str
    timestep: str
    shared: frozenset = frozenset()
    per_row: frozenset = frozenset()


_FLAGS = frozenset({"return_dict", "joint_attention_kwargs", "attention_kwargs", "cross_attention_kwargs"})

# Per model class (its name, found in the class's MRO so subclasses and FSDP2's FSDP<name> classes match):
# which argument is the latent, which the timestep (positional or keyword: bound by name), and which
# arguments every row shares.
ARGUMENT_ROLES = {
    "FluxTransformer2DModel": ArgumentRoles(
        "hidden_states", "timestep",
        _FLAGS | {"img_ids", "txt_ids", "controlnet_block_samples", "controlnet_single_block_samples",
                  "controlnet_blocks_repeat"}),
    "QwenImageTransformer2DModel": ArgumentRoles(
        "hidden_states", "timestep", _FLAGS | {"controlnet_block_samples"},
        frozenset({"img_shapes", "txt_seq_lens"})),
    "SD3Transformer2DModel": ArgumentRoles(
        "hidden_states", "timestep", _FLAGS | {"block_controlnet_hidden_states", "skip_layers"}),
    "UNet2DConditionModel": ArgumentRoles(
        "sample", "timestep",
        _FLAGS | {"down_block_additional_residuals", "mid_block_additional_residual",
                  "down_intrablock_additional_residuals"}),
    "WanTransformer3DModel": ArgumentRoles("hidden_states", "timestep", _FLAGS),
    # fastvideo's (DanceGRPO's HunyuanVideo and SkyReels trainers) and diffusers' class of this name
    "HunyuanVideoTransformer3DModel": ArgumentRoles("hidden_states", "timestep", _FLAGS),
}
_TIMESTEP_NAMES = ("timestep", "timesteps", "t")

ROW, SHARED, OPAQUE = "row", "shared", "opaque"


def _explicit(signature):
    """Whether a forward signature names its arguments (not only *args / **kwargs)."""
    kinds = {p.kind for p in signature.parameters.values()}
    return bool(kinds - {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD})


def _known_class(model):
    return next((cls.__name__ for cls in type(model).__mro__ if cls.__name__ in ARGUMENT_ROLES), None)


def inner_model(model):
    """The model whose forward the calls are bound to: through wrappers whose forward only passes
    *args / **kwargs on (DDP, FSDP1, peft, torch.compile, a module holding `.module`)."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        if _known_class(model) or _explicit(inspect.signature(model.forward)):
            return model
        for step in (lambda m: m.module, lambda m: m._orig_mod, lambda m: m.get_base_model()):
            try:
                found = step(model)
            except (AttributeError, TypeError):
                continue
            if isinstance(found, torch.nn.Module):
                model = found
                break
    return model


@dataclass(frozen=True)
class CallShape:
    """How the calls to one model are read: its forward's signature and the argument roles."""
    signature: inspect.Signature
    roles: ArgumentRoles
    model_class: str
    listed: bool   # whether ARGUMENT_ROLES lists the class (else: per-row arguments told by shape)

    @classmethod
    def of(cls, model, timestep=None, latent=None):
        inner = inner_model(model)
        signature = inspect.signature(inner.forward)
        name = _known_class(inner)
        if not _explicit(signature):
            raise DeferredError(f"{type(inner).__name__}.forward takes only *args / **kwargs, so its rows cannot be "
                                "told apart: wrap the model whose forward names its arguments, or pass "
                                "signature_of=<that model>")
        params = list(signature.parameters)
        roles = ARGUMENT_ROLES.get(name) if name else None
        if roles is None:
            found = timestep or next((p for p in _TIMESTEP_NAMES if p in params), None)
            if found is None:
                raise DeferredError(f"{type(inner).__name__}.forward{tuple(params)}: no argument named like a "
                                    "timestep; say which one the alpha rules read: wrap(model, config, "
                                    "timestep=NAME)")
            roles = ArgumentRoles(latent or params[0], found, _FLAGS)
        elif timestep or latent:
            roles = dataclasses.replace(roles, timestep=timestep or roles.timestep, latent=latent or roles.latent)
        for what, arg in (("timestep", roles.timestep), ("latent", roles.latent)):
            if arg not in params:
                raise DeferredError(f"{type(inner).__name__}.forward has no argument {arg!r} (the {what})")
        return cls(signature, roles, name or type(inner).__name__, name is not None)


def _holds_tensor(value):
    if torch.is_tensor(value):
        return True
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v) for v in value)
    if isinstance(value, dict):
        return any(_holds_tensor(v) for v in value.values())
    return False


def _role(name, value, rows, roles):
    if name == roles.latent:
        return ROW
    if name in roles.shared:
        return SHARED
    if name in roles.per_row:
        return ROW if isinstance(value, (list, tuple)) and len(value) == rows else SHARED
    if torch.is_tensor(value):
        return ROW if value.ndim >= 1 and value.shape[0] == rows else SHARED
    return OPAQUE if _holds_tensor(value) else SHARED


def row_timesteps(value, rows):
    """The timestep of each row as the model receives it, float64 [rows] on the host."""
    if value is None:
        raise DeferredError("the model was called without its timestep")
    # A Python number keeps its float64 value (as_tensor alone would round it to float32 first).
    t = (value.detach().to("cpu", torch.float64) if torch.is_tensor(value)
         else torch.as_tensor(value, dtype=torch.float64)).reshape(-1)
    if t.numel() == 1:
        return t.expand(rows).clone()
    if t.numel() != rows:
        raise DeferredError(f"a timestep of {t.numel()} values cannot go with {rows} rows")
    return t


_WEIGHTS = {}


def _weights(numel, device):
    key = (numel, str(device))
    if key not in _WEIGHTS:
        g = torch.Generator().manual_seed(numel)
        _WEIGHTS[key] = torch.randint(-2 ** 62, 2 ** 62, (2, numel), generator=g, dtype=torch.int64).to(device)
    return _WEIGHTS[key]


def _fingerprints(tensor):
    # The float64 bits of each value as an integer; sums of integers wrap modulo 2^64, a ring, so their
    # order does not matter: a row gives the same fingerprint in any batch, at any offset, in one pass
    # over the whole tensor (float sums would depend on how the reduction is split).
    rows = tensor.shape[0]
    bits = tensor.detach().reshape(rows, -1).to(torch.float64).contiguous().view(torch.int64)
    weights = _weights(bits.shape[1], bits.device)
    return torch.stack([bits.sum(1), (bits * weights[0]).sum(1), (bits * weights[1]).sum(1)], dim=1)


_KNOWN = OrderedDict()   # (id, version, shape, dtype) -> (a weak reference to the tensor, its fingerprints)


def row_fingerprints(tensor):
    """[rows, 3] int64 on the tensor's device: per row the sum of its values' float64 bits read as
    integers and two fixed random projections of them, all modulo 2^64: equal values give equal
    fingerprints whatever batch, offset or dtype the row came in (a value cast to float64 keeps its
    bits), and a changed value changes all three. A tensor passed again unchanged (a micro-batch's
    conditioning, in each of its calls) is not read again: the same object, at the same version."""
    key = (id(tensor), tensor._version, tuple(tensor.shape), tensor.dtype)
    known = _KNOWN.get(key)
    if known is not None and known[0]() is tensor:
        _KNOWN.move_to_end(key)
        return known[1]
    prints = _fingerprints(tensor)
    _KNOWN[key] = (weakref.ref(tensor), prints)
    if len(_KNOWN) > 256:
        _KNOWN.popitem(last=False)
    return prints


def _autocast_state():
    states = []
    for device in ("cpu", "cuda"):
        enabled = torch.is_autocast_enabled(device)
        states.append((device, enabled, torch.get_autocast_dtype(device) if enabled else None))
    return tuple(states)


def _shared_signature(value):
    """A hashable description of a shared argument's value (tensors by shape, dtype and content)."""
    if torch.is_tensor(value):
        return ("tensor", tuple(value.shape), value.dtype, str(value.device),
                tuple(row_fingerprints(value.reshape(1, -1))[0].tolist()) if value.numel() else ())
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_shared_signature(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((k, _shared_signature(v)) for k, v in value.items())))
    return ("object", id(value))


@dataclass
class Call:
    """One call of the model: its bound arguments, rows, the roles of its arguments, each row's
    timestep and key, the autocast and train / eval mode it ran under; for a call in grad mode also
    its call-time output, the leaf handed to the loop and where each row was placed."""
    arguments: dict
    shape: CallShape
    rows: int
    roles: dict
    t: torch.Tensor
    keys: list
    autocast: tuple
    training: bool
    versions: dict = field(default_factory=dict)
    trainable: frozenset = None   # the parameters (ids) that required grad at the call
    output: torch.Tensor = None
    leaf: torch.Tensor = None
    placements: list = None
    _shared_key: tuple = field(default=None, repr=False)

    @classmethod
    def bind(cls, shape, args, kwargs, training):
        bound = shape.signature.bind(*args, **kwargs)
        arguments = dict(bound.arguments)
        latent = arguments.get(shape.roles.latent)
        if not torch.is_tensor(latent) or latent.ndim < 1:
            raise DeferredError(f"the model's latent argument {shape.roles.latent!r} is not a batched tensor")
        rows = latent.shape[0]
        roles = {name: _role(name, value, rows, shape.roles) for name, value in arguments.items()}
        t = row_timesteps(arguments.get(shape.roles.timestep), rows)
        call = cls(arguments, shape, rows, roles, t, [], _autocast_state(), training,
                   {n: v._version for n, v in arguments.items() if torch.is_tensor(v)})
        call.keys = call._row_keys()
        return call

    @property
    def splittable(self):
        return OPAQUE not in self.roles.values()

    def _row_keys(self):
        # Per-row scalars (a guidance value) are left out: a [1] guidance is per-row in a call of one row
        # and shared in a call of several, and a key must not depend on the call's size.
        roles, latent = self.shape.roles, self.shape.roles.latent
        tensors = [latent] + sorted(n for n, r in self.roles.items() if r == ROW and n not in (latent, roles.timestep)
                                    and torch.is_tensor(self.arguments[n]) and self.arguments[n][0].numel() > 1)
        prints = torch.stack([row_fingerprints(self.arguments[n]) for n in tensors], dim=1).cpu().tolist()
        lists = sorted(n for n, r in self.roles.items() if r == ROW and not torch.is_tensor(self.arguments[n]))
        return [(tuple(map(tuple, prints[r])), float(self.t[r]), tuple(repr(self.arguments[n][r]) for n in lists))
                for r in range(self.rows)]

    def changed_arguments(self):
        """The tensor arguments modified in place since the call."""
        return [n for n, v in self.versions.items() if self.arguments[n]._version != v]

    def shared_key(self):
        """What the rows of one replay chunk must have in common: the argument names and each shared
        argument's value, the per-row arguments' shapes past the batch, the autocast and the mode. Read
        once (a call's arguments changed in place are refused at the flush)."""
        if self._shared_key is None:
            self._shared_key = self._read_shared_key()
        return self._shared_key

    def _read_shared_key(self):
        parts = []
        for name, value in self.arguments.items():
            if self.roles[name] == ROW:
                parts.append((name, "row", (tuple(value.shape[1:]), value.dtype) if torch.is_tensor(value)
                              else type(value).__name__))
            else:
                parts.append((name, _shared_signature(value)))
        return (tuple(parts), self.autocast, self.training)

    def bound(self, arguments):
        """(args, kwargs) of a call with these bound arguments."""
        ba = inspect.BoundArguments(self.shape.signature, arguments)
        return ba.args, ba.kwargs


def gather_rows(parts):
    """The arguments of one call on rows taken from several calls: parts = [(call, rows)], every
    call with the same shared_key(); per-row arguments concatenated in that order, the shared ones
    taken from the first call."""
    first = parts[0][0]
    arguments = {}
    for name, value in first.arguments.items():
        if first.roles[name] != ROW:
            arguments[name] = value
        elif torch.is_tensor(value):
            arguments[name] = torch.cat([call.arguments[name][rows] for call, rows in parts])
        else:
            arguments[name] = type(value)(call.arguments[name][r] for call, rows in parts for r in rows)
    return arguments


# ---------------------------------------------------------------- outputs

def split_output(output):
    """(the output's tensor, rebuild(tensor) -> the same kind of output around another tensor)."""
    if torch.is_tensor(output):
        return output, lambda t: t
    if isinstance(output, (tuple, list)) and output and torch.is_tensor(output[0]):
        rest = list(output[1:])
        if type(output) in (tuple, list):
            return output[0], lambda t: type(output)([t, *rest])
        return output[0], lambda t: type(output)(t, *rest)   # a namedtuple
    sample = getattr(output, "sample", None)
    if torch.is_tensor(sample) and dataclasses.is_dataclass(output):
        return sample, lambda t: dataclasses.replace(output, sample=t)
    raise DeferredError(f"cannot find the model's output tensor in a {type(output).__name__} (a tensor, a tuple "
                        "starting with one, or an object with .sample)")


def output_form(output):
    """build(tensor) -> an output of this kind holding nothing but that tensor, or None where the
    output holds more (then a call whose rows all come from the rollout still runs its forward)."""
    if torch.is_tensor(output):
        return lambda t: t
    if type(output) in (tuple, list) and len(output) == 1:
        return lambda t: type(output)([t])
    if dataclasses.is_dataclass(output) and torch.is_tensor(getattr(output, "sample", None)):
        others = [f.name for f in dataclasses.fields(output) if f.name != "sample"]
        if all(getattr(output, n) is None for n in others):
            kind = type(output)
            return lambda t: kind(sample=t)
    return None


def form_key(call):
    """Calls that return the same kind of output: by their return_dict argument."""
    return repr(call.arguments.get("return_dict", "<default>"))
