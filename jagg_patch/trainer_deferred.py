"""--jagg_deferred on dancegrpo's trainers: the trainer's own update (vanilla's policy_update,
unpatched) calls the transformer through jagg_patch.deferred's proxy.

Only the trainer module's `train_one_step(ctx)` seam is wrapped (jagg_patch.seams): at the first step
it puts the proxy in ctx.transformer (the engine keeps the model it holds, for its clip, state dicts
and EMA), attached to the engine's optimizer, and makes the engine's `optimizer_step` flush first
(its clip reads which parameters have a gradient before it clips); every step's record gets the
proxy's counts of that step, summed over the ranks. The groups, routing and gradient are the restated
update's (jagg_patch.update), the rows a group's samples share under --init_same_noise included: the
flush places them (docs/deferred.md).
"""

from .deferred import DeferredModel, wrap
from .deferred.stats import flush_record


def install(ctx, config):
    """ctx.transformer behind the proxy, attached to the engine's optimizer; the engine's optimizer_step
    flushes first."""
    transitions = ctx.args.sampling_steps - 1 if config.grouping == "window" else None
    proxy = wrap(ctx.transformer, config, transitions=transitions).attach(ctx.engine.optimizer)
    step = ctx.engine.optimizer_step

    def optimizer_step(check_norm):
        proxy.flush()
        return step(check_norm)

    ctx.engine.optimizer_step = optimizer_step
    ctx.transformer = proxy


def deferred_train_one_step(original, config):
    """A train_one_step(ctx) that runs `original` with ctx.transformer behind the deferred proxy."""
    def train_one_step(ctx):
        if not isinstance(ctx.transformer, DeferredModel):
            install(ctx, config)
        before = len(ctx.transformer.stats)
        record = original(ctx)
        record.update(flush_record(ctx.transformer.stats[before:], ctx.device))
        return record

    train_one_step.__name__ = "train_one_step"
    train_one_step.jagg_deferred = config
    return train_one_step
