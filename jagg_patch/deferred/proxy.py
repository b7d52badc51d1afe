"""The deferred proxy: JAGG for a GRPO loop left as it is.

The loop calls the proxy where it called the model. A call under no_grad passes through (a rollout
step is recorded: jagg_patch.deferred.record); so is one made on the model inside, past the proxy (a
rollout through `pipeline.unet` while the update calls the prepared DDP wrapper), seen by a forward
hook. A call in grad mode runs without grad (or takes the rollout's own output) and returns the
output as a fresh leaf, so the loop's own log-prob, clip, KL and scaling compute each row's upstream
gradient s_j into the leaf's .grad when the loop calls backward. Before the parameters' gradient is
read (a clip, the optimizer's step: jagg_patch.deferred.hooks) the proxy flushes: it places each row
in its trajectory, cuts the groups, folds the signals onto the endpoints (jagg_patch.deferred.fold)
and replays the endpoints with grad, the parameters being those of the calls, each trained as it was
at its call (a parameter frozen since still gets what its rows gave it, as in vanilla)
(jagg_patch.deferred.replay). Whatever reads, clears or routes the parameters' gradient meanwhile meets
jagg_patch.deferred.hooks first.
"""
import functools
import time
import weakref

import torch

from .calls import Call, CallShape, form_key, gather_rows, inner_model, output_form, split_output
from .errors import DeferredError
from .fold import pending_rows, plan_replay
from .hooks import arm, calling, disarm, own_calls, real_optimizer, register, watch
from .record import IDENTICAL, RolloutRecord, reuse_context
from .replay import Replayer, guard, called_as, chunk_rows, make_chunks, trainable_as
from .stats import FlushStats

_OWN = ("wrapped", "jagg_config", "stats", "on_flush")   # every other attribute is the model's (.config, .module)


def check_config(config, transitions=None):
    """The settings a deferred update can serve, else one line naming the fix. transitions: the trainable
    transitions of a trajectory (S - 1), given where the loop trains the window grouping's windows."""
    if config.grouping != "trained" and transitions is None:
        raise DeferredError("jagg_patch.deferred groups the steps the loop trains (--jagg_grouping trained); the "
                            "window grouping chooses the trained steps itself, which a loop left as it is does not "
                            "let it do (a loop that trains whole windows: wrap(model, config, transitions=S-1))")
    if config.grouping == "window" and transitions % config.window:
        raise DeferredError(f"jagg_patch.deferred's window grouping needs the window ({config.window}) to divide the "
                            f"{transitions} trainable transitions, as the authors' code does")
    if config.auto or config.monitor_every:
        raise DeferredError("jagg_patch.deferred has no fidelity monitor (--jagg_monitor_every, --jagg_frac auto): "
                            "give a fixed --jagg_frac, or use the restated update")


def refuse_mode_dependent(model):
    """Dropout (p > 0) draws what a replay cannot draw again; batch norm couples the rows."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            raise DeferredError(f"jagg_patch.deferred cannot replay {type(module).__name__}(p={module.p}) at "
                                f"{name or 'the model'}: the replay would draw another mask than the call; set its p "
                                "to 0 or use the restated update")
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            raise DeferredError(f"jagg_patch.deferred cannot replay rows apart through {type(module).__name__} at "
                                f"{name}: batch norm couples a batch's rows")


class DeferredModel:
    """See the module. `wrap(model, config)` makes one; `attach(optimizer)`, `flush()`, `stats` (one
    FlushStats per flush), `on_flush` (callbacks fn(proxy, stats) after each flush, on every rank),
    `close()`, `wrapped` (the model), `jagg_config`; every other attribute is the wrapped model's."""

    def __init__(self, model, config, *, timestep=None, latent=None, signature_of=None, replay_tolerance=None,
                 transitions=None):
        if isinstance(model, DeferredModel):
            raise DeferredError("jagg_patch.deferred: the model is a deferred proxy already (wrap of a wrap): wrap the "
                                "model once, and use that proxy wherever the loop calls it")
        check_config(config, transitions)
        refuse_mode_dependent(model)
        self._transitions = transitions
        self.wrapped, self.jagg_config, self.stats, self.on_flush = model, config, [], []
        self._shape = CallShape.of(signature_of or model, timestep, latent)
        self._replayer = Replayer(model)
        self._mode_module = inner_model(model)
        self._tolerance = replay_tolerance
        self._record = RolloutRecord(keep_outputs=config.reuse != "off" and config.mode != "exact")
        self._pending, self._pending_keys, self._forms = [], set(), {}
        self._current, self._last_call, self._flushing = FlushStats(), None, False
        self._optimizers, self._versions = [], None
        self._writes, self._trainable_sets = set(), {}   # what the pending rows write to; each distinct trainable set
        self._params = list(model.parameters())
        self._owned = {id(p) for p in self._params}
        inner = inner_model(signature_of or model)
        observer = inner.register_forward_hook(functools.partial(_observe, weakref.ref(self), weakref.ref(inner)),
                                               with_kwargs=True)
        self._finalizers = [weakref.finalize(self, observer.remove), register(self, self._params)]
        self._closed = False

    # ------------------------------------------------------------ the model's attributes
    def __getattr__(self, name):
        if name.startswith("_") or name in _OWN:
            raise AttributeError(name)
        return getattr(self.wrapped, name)

    def __repr__(self):
        return (f"DeferredModel({type(self.wrapped).__name__}, window={self.jagg_config.window}, "
                f"jagg_frac={self.jagg_config.jagg_frac}, pending={len(self._pending)})")

    # ------------------------------------------------------------ calls
    def __call__(self, *args, **kwargs):
        if self._closed:
            return self.wrapped(*args, **kwargs)
        if not torch.is_grad_enabled():
            return self._pass_through(args, kwargs)
        try:
            call = Call.bind(self._shape, args, kwargs, self._mode_module.training)
        except TypeError:
            return self._replayer.target(*args, **kwargs)   # the model's own error for a bad call
        return self._defer(call, args, kwargs)

    def _pass_through(self, args, kwargs):
        with own_calls():
            output = self._replayer.target(*args, **kwargs)
        self._record_call(args, kwargs, output)
        return output

    def _record_call(self, args, kwargs, output):
        try:
            call = Call.bind(self._shape, args, kwargs, self._mode_module.training)
            tensor, _ = split_output(output)
        except (TypeError, DeferredError):
            return   # a call the update never makes (another signature): nothing to record
        if self._record.observe(call, tensor, self._pending_keys):
            self._current.rollout_rows += call.rows
        self._forms.setdefault(form_key(call), output_form(output))

    def _defer(self, call, args, kwargs):
        self._record.in_update = True
        if not self._pending:
            self._start_pending()
        call.trainable = self._trainable_now()
        call.placements = [self._record.place(key) for key in call.keys]
        tensor, rebuild = self._call_time_output(call, args, kwargs)
        call.output = tensor.detach()
        call.leaf = call.output.detach().requires_grad_(True)
        self._pending.append(call)
        self._pending_keys.update(call.keys)
        self._last_call = call
        self._current.calls += 1
        self._current.rows_deferred += call.rows
        # The loop gets a copy: it may change its output in place, the call-time output stays.
        return rebuild(call.leaf.clone())

    def _call_time_output(self, call, args, kwargs):
        """(the call's output tensor without a graph, rebuild): the rollout's own outputs for the rows
        where they stand for the model's (self._reusable), a forward without grad for the others (on
        those rows alone where the call's arguments can be cut by row, else on the whole call)."""
        reused = self._reusable(call)
        form = self._forms.get(form_key(call))
        whole = all(r is not None for r in reused)
        if self._replayer.agreed(whole and form is not None):
            self._current.forwards_reused += call.rows
            return torch.stack(reused), form
        missing = [r for r, v in enumerate(reused) if v is None]
        if form is None or not call.splittable or len(missing) in (0, call.rows):
            missing = list(range(call.rows))
            forward_args, forward_kwargs = args, kwargs
        else:
            forward_args, forward_kwargs = call.bound(gather_rows([(call, missing)]))
        with torch.no_grad(), own_calls():
            output = self._replayer.target(*forward_args, **forward_kwargs)
        computed, rebuild = split_output(output)
        if len(missing) == call.rows:
            self._forms.setdefault(form_key(call), output_form(output))
            self._current.forwards_nograd += call.rows
            return computed, rebuild
        tensor = torch.empty((call.rows, *computed.shape[1:]), dtype=computed.dtype, device=computed.device)
        tensor[missing] = computed
        kept = [r for r in range(call.rows) if reused[r] is not None]
        tensor[kept] = torch.stack([reused[r] for r in kept]).to(computed.dtype)
        self._current.forwards_nograd += len(missing)
        self._current.forwards_reused += len(kept)
        return tensor, form

    def _reusable(self, call):
        """Per row, the rollout's own output where it is the model's now (no optimizer step since, or
        reuse 'always') and ran under the same autocast and dtypes; None for the others. A row several
        rollout rows share takes the first's (one input, one output)."""
        config, record = self.jagg_config, self._record
        if not (record.keep_outputs and (not record.stale or config.reuse == "always")
                and (self._optimizers or config.reuse == "always")):
            return [None] * call.rows
        outputs = []
        for r, (entry, why) in enumerate(call.placements):
            if entry is None and why == IDENTICAL:
                entry = record.candidates(call.keys[r])[0]
            usable = entry is not None and entry.output is not None and entry.context == reuse_context(call, r)
            outputs.append(entry.output if usable else None)
        return outputs

    # ------------------------------------------------------------ what the pending rows write to
    def _start_pending(self):
        """The first pending row since the last flush: the parameters as they are now (a model may have
        been given others), their versions, and the hooks armed."""
        self._params = list(self.wrapped.parameters())
        self._owned = {id(p) for p in self._params}
        watch(self._params)   # a parameter of a class not seen before gets the .grad hook too
        self._versions = self._parameter_versions()
        arm(self)

    def _trainable_now(self):
        """The parameters that require grad now (ids), one object per distinct set: each row is replayed
        with the set it was called with."""
        now = frozenset(id(p) for p in self._params if p.requires_grad)
        known = self._trainable_sets.get(now)
        if known is None:
            known = self._trainable_sets[now] = now
            self._writes |= now
        return known

    def writes_to(self, param):
        return id(param) in self._writes

    def pending_writes(self):
        """The parameters (ids) the pending rows give gradient to at the flush."""
        return self._writes

    def pending_leaves(self):
        """The outputs handed to the loop by the pending calls (their .grad is each row's signal)."""
        return [call.leaf for call in self._pending]

    def owns_any(self, ids):
        return not self._owned.isdisjoint(ids)

    def _clear_pending(self):
        self._pending, self._pending_keys, self._writes, self._trainable_sets = [], set(), set(), {}
        disarm(self)

    # ------------------------------------------------------------ the optimizer
    def attach(self, optimizer):
        """The optimizer that steps the model (a wrapper's: the optimizer it holds). Every torch
        optimizer's step flushes first and makes the rollout's outputs stale, attached or not; an
        attached one lets --jagg_reuse_rollout on_policy trust that no other update goes unseen.
        Returns the proxy."""
        self._optimizers.append(real_optimizer(optimizer))
        return self

    def note_step(self):
        """An optimizer step: the rollout's outputs are not the model's any more."""
        self._record.stale = True

    def note_fresh_rollout(self):
        """The rollout's outputs are the model's again (a benchmark running the update again on the same
        rollout and weights)."""
        self._record.stale = False

    def drop_pending(self):
        """What a zero_grad erases of vanilla's gradient: the rows not yet flushed (counted in the next
        flush's rows_dropped, not in its rows deferred)."""
        if self._pending and not self._flushing:
            dropped = sum(call.rows for call in self._pending)
            self._clear_pending()
            self._current = FlushStats(rollout_rows=self._current.rollout_rows,
                                       rows_dropped=self._current.rows_dropped + dropped)

    def close(self, flush=True):
        """Flush what is pending (unless flush=False: a run stopping on an error), then remove the hooks;
        the proxy calls the model as it is from then on. The patches go with the last live proxy."""
        if flush and self._pending:
            self.flush()
        self._clear_pending()
        self._closed = True
        for finalizer in self._finalizers:
            finalizer()

    # ------------------------------------------------------------ the flush
    def _parameter_versions(self):
        # Every parameter, trainable or frozen (freezing does not change a version; a frozen weight loaded
        # anew changes what the replay computes). FSDP swaps its parameters' storage in every forward: its
        # versions say nothing there.
        if self._replayer.kind == "collective":
            return None
        return sum(p._version for p in self._params)

    def _check_parameters(self):
        if self._versions is not None and self._parameter_versions() != self._versions:
            raise DeferredError("jagg_patch.deferred: the model's weights changed in place between a deferred call and "
                                "its flush, outside any torch optimizer's step (weights loaded, an EMA swapped in, a "
                                "hand-written update): call proxy.flush() before changing them")

    def flush(self):
        """Place, fold and replay every pending row; returns this flush's FlushStats (None when no rank
        had anything pending)."""
        if self._flushing or not self._replayer.most(len(self._pending)):
            return None
        self._flushing, started, stats = True, time.time(), self._current
        disarm(self)   # the replay's own reads of .grad (FSDP's hooks) are not the loop's
        try:
            self._check_parameters()
            changed = sorted({n for call in self._pending for n in call.changed_arguments()})
            if changed:
                raise DeferredError(f"jagg_patch.deferred: the loop changed the argument(s) {changed} of a deferred call "
                                    "in place before the flush; the replay cannot see what the call saw")
            replays = plan_replay(pending_rows(self._pending), self.jagg_config, stats, self._record.candidates,
                                  self._transitions)
            call_rows = max((call.rows for call in self._pending), default=1)
            chunks = make_chunks(replays, chunk_rows(call_rows, self.jagg_config.backward), self._pending)
            template = self._pending[-1] if self._pending else self._last_call
            if template is None:
                raise DeferredError("jagg_patch.deferred: another rank flushes, but this one has never been called in "
                                    "grad mode: its share of the collectives has no row to run")
            self._replayer.run(chunks, template, lambda chunk, target: self._run_chunk(chunk, target, stats), stats)
        finally:
            self._clear_pending()
            self._flushing = False
            stats.time_s = time.time() - started
            self._current = FlushStats()
        self.stats.append(stats)
        for callback in self.on_flush:
            callback(self, stats)
        return stats

    @property
    def device(self):
        """Where the model's parameters are (the collectives' device)."""
        return self._replayer.device()

    def _run_chunk(self, chunk, target, stats):
        call = chunk.parts[0][0]
        args, kwargs = call.bound(chunk.arguments())
        # requires_grad as at the call through the backward too: AccumulateGrad skips a parameter that does not
        with trainable_as(call.trainable, self._params), own_calls():
            with called_as(call, self._mode_module, self.wrapped):
                tensor, _ = split_output(target(*args, **kwargs))
            guard(chunk, tensor, stats, self._tolerance)
            torch.autograd.backward([tensor], [chunk.signals.to(tensor.dtype)])
        stats.forwards_grad += chunk.rows
        stats.backward_calls += 1


def _observe(ref, inner, module, args, kwargs, output):
    """A call of the model inside made past every proxy (the forward hook): recorded when without grad.
    It holds the proxy weakly (a model outliving its proxy does not keep it alive) and records calls of
    that model only (a deepcopy of the model carries the hook: its calls are another model's)."""
    proxy = ref()
    if proxy is not None and module is inner() and not calling() and not torch.is_grad_enabled():
        proxy._record_call(args, kwargs, output)


def wrap(model, config, **options):
    """A DeferredModel of `model` (the object the loop calls: a plain model, DDP, FSDP1 or FSDP2) with
    `config` (a jagg_patch.JaggConfig). options: timestep= / latent= (the argument names, for a model
    class jagg_patch.deferred.calls.ARGUMENT_ROLES does not list), signature_of= (the model whose
    forward names the arguments, when `model`'s takes only *args / **kwargs), replay_tolerance= (the
    guard's relative bound instead of the one for the rows' precision), transitions= (the trainable
    transitions of a trajectory, S - 1: the authors' window grouping, for a loop that trains whole windows,
    each row's window told by its rollout position)."""
    return DeferredModel(model, config, **options)
