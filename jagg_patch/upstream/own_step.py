"""The upstream file's own train_one_step, as it is: its transformer behind jagg_patch.deferred's proxy
(JAGG with a deferred backward), or untouched (--jagg_mode exact). Nothing of the file is restated:
its rollout, advantages, draws, prints, reward files, clip and cadence are its own. The adapter
puts the proxy in place of the transformer argument (attached to the optimizer argument), counts the
passes, and writes its jagg_metrics.jsonl line, the rewards read back from the lines the step
appended to its own reward files.

This is what runs for a train_one_step that is no release the adapter knows (an edited line, another
release), for --jagg_deferred, and for --jagg_mode exact.
"""
import inspect
import os
import time
import uuid

import torch

from dancegrpo.utils.communications import sum_over_ranks, world_size
from dancegrpo.utils.metrics import PassCounter

from ..deferred import wrap
from ..deferred.stats import flush_record
from ..metrics_file import write_step_line
from .families import FAMILIES
from .fingerprint import UpstreamUnsupported

MODEL_ARGUMENT, OPTIMIZER_ARGUMENT = "transformer", "optimizer"
# The reward files' mean-reward line, by file, as this adapter's records name it.
REWARD_FIELDS = {"reward.txt": "reward_mean", "hps_reward.txt": "reward_mean", "vq_reward.txt": "vq_reward_mean",
                 "mq_reward.txt": "mq_reward_mean"}


def _trainable_module(value):
    return isinstance(value, torch.nn.Module) and any(p.requires_grad for p in value.parameters())


def _optimizer(value):
    # a wrapper of accelerate's is a torch Optimizer too; a scheduler holds one as .optimizer but is none
    return isinstance(value, torch.optim.Optimizer)


def find_arguments(arguments, file, optimizer=True):
    """(the model's argument name, the optimizer's or None): by upstream's names, else the one argument of
    each kind (a release whose parameter names are not known); one line where it cannot tell. optimizer:
    whether one is looked for (the deferred proxy attaches to it; the step as it is needs none)."""
    found = []
    kinds = ((MODEL_ARGUMENT, _trainable_module, "a model with trainable parameters"),
             (OPTIMIZER_ARGUMENT, _optimizer, "a torch optimizer"))
    for name, test, what in kinds[:2 if optimizer else 1]:
        if test(arguments.get(name)):
            found.append(name)
            continue
        matching = [n for n, v in arguments.items() if test(v)]
        if len(matching) != 1:
            raise UpstreamUnsupported(f"{os.path.basename(file)}: train_one_step got {len(matching)} arguments that "
                                      f"are {what} ({matching}) and none named {name!r}: jagg_patch.upstream cannot "
                                      "tell which one to run through the deferred proxy")
        found.append(matching[0])
    return found if optimizer else [*found, None]


class RewardLines:
    """The mean-reward lines a step appends to its reward files (on the rank that writes them)."""

    def __init__(self, paths):
        self.sizes = {path: os.path.getsize(path) if os.path.isfile(path) else 0 for path in paths}

    def read(self):
        fields = {}
        for path, size in self.sizes.items():
            if not os.path.isfile(path):
                continue
            with open(path) as f:
                f.seek(size)
                lines = f.read().split()
            if lines:
                field = REWARD_FIELDS.get(os.path.basename(path), f"{os.path.basename(path).split('.')[0]}_mean")
                fields.setdefault(field, float(lines[-1]))
        if "reward_mean" not in fields and fields:
            fields["reward_mean"] = next(iter(fields.values()))
        return fields


def _returned(result):
    """upstream's (total_loss, grad_norm), where the step returns them."""
    if isinstance(result, tuple) and len(result) == 2 and all(isinstance(v, (int, float)) for v in result):
        return {"loss": float(result[0]), "grad_norm": float(result[1])}
    return {}


def own_train_one_step(trainer, config, original, deferred):
    """A function with the file's own train_one_step parameters that runs it, the transformer behind the
    deferred proxy when `deferred` (else as it is), and writes the step's line."""
    signature, run_id = inspect.signature(original), uuid.uuid4().hex[:12]
    proxies = {}   # id(model) -> the proxy made at the first step, kept for the run
    update = "deferred" if deferred else "own step"

    def train_one_step(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        model_name, optimizer_name = find_arguments(bound.arguments, trainer.file, optimizer=deferred)
        model, run_args = bound.arguments[model_name], bound.arguments.get("args")
        proxy = None
        if deferred:
            proxy = proxies.get(id(model))
            if proxy is None:
                proxy = proxies[id(model)] = wrap(model, config).attach(bound.arguments[optimizer_name])
            bound.arguments[model_name] = proxy
        rows = FAMILIES[trainer.family].call_rows(run_args) if trainer.family in FAMILIES else 1
        counter, rewards = PassCounter(model, rows), RewardLines(trainer.reward_files)
        before, started = len(proxy.stats) if proxy is not None else 0, time.time()
        try:
            result = original(*bound.args, **bound.kwargs)
        finally:
            counter.remove()
        train_one_step.calls += 1
        device = bound.arguments.get("device") or next(model.parameters()).device
        record = {"step": train_one_step.calls, "run_id": run_id, "family": trainer.family,
                  "release": trainer.release_text(), "update": update, **config.as_dict(),
                  **sum_over_ranks(counter.as_dict(), device), "world_size": world_size(),
                  **(flush_record(proxy.stats[before:], device) if proxy is not None else {}),
                  **_returned(result), **rewards.read(), "step_time_s": time.time() - started}
        train_one_step.last_stats = record
        write_step_line(run_args, record, train_one_step.calls, device)
        return result

    train_one_step.__signature__ = signature
    train_one_step.__name__ = original.__name__
    train_one_step.calls, train_one_step.last_stats = 0, None
    train_one_step.jagg_config, train_one_step.jagg_family = config, trainer.family
    train_one_step.jagg_trainer, train_one_step.jagg_update = trainer, update
    return train_one_step
