"""The Flow-GRPO stand-in on two DDP ranks (accelerate's multi-CPU mode on gloo), each setting run as it
is, recorded, and through `python -m jagg_patch.deferred`'s main, in ONE torchrun launch (a start costs
about 15 s of imports): every rank saves its gradients, its own rows' references and its counts.

Usage: ACCELERATE_USE_CPU=true torchrun --nproc_per_node=2 tests/dist/flowgrpo_ranks.py OUT_DIR
"""
import json
import os
import sys
import types
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the suite's helpers

from flowgrpo_harness import run_case  # noqa: E402 (after the helpers folder is on sys.path)

# name -> (the stand-in's flags, the launcher's JAGG flags, the reference's settings)
CASES = {
    "cfg_kl_w3": (["--config.train.cfg=True", "--config.train.beta=0.04"], ["--jagg_window", "3", "--jagg_frac", "1"],
                  dict(window=3, jagg_frac=1.0, mode="jagg", alpha="timestep")),
    "nocfg_kl_w5": (["--config.train.cfg=False", "--config.train.beta=0.04"],
                    ["--jagg_window", "5", "--jagg_frac", "1", "--jagg_alpha", "index"],
                    dict(window=5, jagg_frac=1.0, mode="jagg", alpha="index")),
}


def main(out_dir):
    warnings.filterwarnings("ignore", category=FutureWarning)
    for name, (flags, jagg_flags, reference) in CASES.items():
        result = run_case(flags, jagg_flags, types.SimpleNamespace(**reference), os.path.join(out_dir, name))
        rank = dist.get_rank()
        torch.save(result, os.path.join(out_dir, f"{name}.rank{rank}.pt"))
        if rank == 0:
            print(json.dumps({"case": name, "signal_error": result["signal_error"]}), flush=True)
    dist.barrier()   # the process group is accelerate's; a clean end for both ranks
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
