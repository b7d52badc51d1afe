"""The optimizer state of a checkpoint, saved sharded: each rank writes its own shard with
torch.distributed.checkpoint (DCP), so no rank ever holds the full Adam state (2 x the fp32
model: about 96 GB for Flux, 160 GB for Qwen-Image) and the files together are that size once.

    <folder>/.metadata            (which shard holds what; written by rank 0 after every rank wrote)
    <folder>/__<rank>_0.distcp    (one file per rank)

The folder must be on a file system every rank sees (as the checkpoint folder itself).
"""
import contextlib
import os
import warnings

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)

METADATA = ".metadata"
_KEY = "optimizer"
_PREFIX = f"{_KEY}.state."
_SHARDED = StateDictOptions(full_state_dict=False, cpu_offload=False)


@contextlib.contextmanager
def _single_process_is_intended():
    # DCP warns on every call without a process group; a single-process run is meant to be one.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save_optimizer(model, optimizer, folder):
    """Collective: every rank writes its shard of the optimizer state into `folder`."""
    with _single_process_is_intended():
        dcp.save({_KEY: get_optimizer_state_dict(model, optimizer, options=_SHARDED)}, checkpoint_id=folder)


def saved_parameters(folder):
    """Names of the parameters that have optimizer state in `folder` (read from the metadata)."""
    keys = FileSystemReader(folder).read_metadata().state_dict_metadata
    # Keys read "optimizer.state.<parameter name>.<state name>"; parameter names hold dots, state names do not.
    return {key[len(_PREFIX):].rsplit(".", 1)[0] for key in keys if key.startswith(_PREFIX)}


def load_optimizer(model, optimizer, folder):
    """Collective: restore the optimizer from its shards (after FSDP wrapping, any world size).

    The template state comes with every parameter initialised; parameters the checkpoint has no
    state for (they never got a gradient) are dropped from it, so they stay without state exactly
    as in the run that saved it."""
    template = get_optimizer_state_dict(model, optimizer, options=_SHARDED)
    have = saved_parameters(folder)
    template["state"] = {name: value for name, value in template["state"].items() if name in have}
    state = {_KEY: template}
    with _single_process_is_intended():
        dcp.load(state, checkpoint_id=folder)
    set_optimizer_state_dict(model, optimizer, optim_state_dict=state[_KEY],
                             options=StateDictOptions(full_state_dict=False, strict=False))


def is_complete(folder):
    return os.path.isfile(os.path.join(folder, METADATA))
