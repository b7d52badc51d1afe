"""Every two-rank check the selected tests ask for, in ONE torchrun launch: a start costs about 15 s
of imports on 2 CPU cores, a check a few seconds.

Usage: torchrun --nproc_per_node=2 tests/dist/run_checks.py CACHE_DIR OUT_DIR SPECS_JSON
SPECS_JSON is a list of {"name", "check", "flags"}, `check` one of CHECKS (the module whose
`check(cache_dir, workdir, flags)` runs on every rank and returns rank 0's result). Rank 0 writes
OUT_DIR/NAME.json. A check that raises stops the launch (its collectives would hang on the other
rank); the results written before it stand.
"""
import datetime
import importlib
import json
import os
import sys
import time

import torch.distributed as dist

# The order they run in: DeepSpeed last, so its global state (comm backend, ZeRO hooks) meets no
# FSDP check after it.
CHECKS = {"grad": "fsdp_grad_check", "comm": "fsdp_comm_check", "jagg_core": "fsdp_jagg_check",
          "monitor": "fsdp_monitor_check", "upstream": "upstream_fsdp_check", "deferred": "deferred_check",
          "deepspeed": "deepspeed_check",
          "deepspeed_monitor": "deepspeed_monitor_check"}


def run_one(spec, cache_dir, out_dir):
    from jagg_patch import revert_jagg
    workdir = os.path.join(out_dir, spec["name"] + ".d")
    os.makedirs(workdir, exist_ok=True)
    cwd = os.getcwd()
    try:
        return importlib.import_module(CHECKS[spec["check"]]).check(cache_dir, workdir, spec["flags"])
    finally:
        os.chdir(cwd)
        revert_jagg()   # --apply_jagg patched the trainer for this check only


def main(cache_dir, out_dir, specs_path):
    # The checks share the suite's helpers (tests/helpers.py), one folder up.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    with open(specs_path) as f:
        specs = sorted(json.load(f), key=lambda s: list(CHECKS).index(s["check"]))
    for spec in specs:
        start = time.perf_counter()
        result = run_one(spec, cache_dir, out_dir)
        dist.barrier()
        if dist.get_rank() == 0:
            with open(os.path.join(out_dir, spec["name"] + ".json"), "w") as f:
                json.dump(result, f)
            print(f"{spec['name']}: {time.perf_counter() - start:.1f} s", flush=True)
    dist.barrier()  # ~1 in 10 CPU runs aborted in destroy_process_group without it
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
