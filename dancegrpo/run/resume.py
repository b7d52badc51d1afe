"""Before any model is loaded: which checkpoint a run resumes, with which seed, and whether it
may (its flags against the checkpoint's run_config.json), into a locked output folder.

`plan_run` is the trainer's (rank 0; `distributed.decide_on_rank0` shares the answer);
`tool_plan` serves tools that load a trainer's setup without a run folder of their own.
"""
import random

from ..utils import checkpoint as ckpt
from ..errors import ConfigError
from .run_config import (CONFIG_NAME, describe_differences, differences, read_run_config, snapshot,
                         world_size_change)
from .rundir import claim_output_dir


def plan_run(args, run_id, log=print, world_size=1):
    """Rank 0, before any model is loaded: which checkpoint to resume, with which seed, into a
    locked output folder. Returns (lock, {"resume": path or None, "seed": int})."""
    resume = ckpt.resolve_resume_path(args.resume_from_checkpoint, args.output_dir, log=log) \
        if args.resume_from_checkpoint else None
    saved = read_run_config(resume) if resume else None
    full_resume = resume is not None and ckpt.checkpoint_problem(resume) is None
    lock = claim_output_dir(args.output_dir, run_id, resuming=full_resume, overwrite=args.overwrite_output_dir,
                            log=log)
    try:
        seed = args.seed
        if saved and "seed" not in getattr(args, "explicit_flags", ["seed"]) and seed != saved["seed"]:
            seed = saved["seed"]
            log(f"notice: no --seed given; using the checkpoint's seed {seed} so the run continues as it was")
        if seed is None:
            seed = random.SystemRandom().randrange(2 ** 31)
        if resume and not full_resume:
            log(f"notice: {resume!r} holds weights only (an upstream DanceGRPO checkpoint-STEP-EPOCH or "
                "checkpoint-ema-STEP-EPOCH folder, or one without training state): training starts from these "
                "weights at step 0 with FRESH optimizer state, learning-rate schedule and EMA")
        elif resume and saved is None:
            log(f"notice: {resume!r} has no {CONFIG_NAME}: the flags cannot be compared with the run that "
                "wrote it")
        current = snapshot(args, seed, world_size)
        diffs = differences(saved, current) if saved else []
        ranks = world_size_change(saved, current) if saved else None
        if ranks and not args.allow_config_change:
            # Named first: the per-rank values a preset splits over the ranks differ only because of it.
            also = f" (so do per-rank flags: {describe_differences(diffs)})" if diffs else ""
            raise ConfigError(f"resuming {resume!r}, written by {ranks[0]} rank(s), on {ranks[1]}{also}. Resume "
                              f"with {ranks[0]} rank(s) (torchrun --nproc_per_node {ranks[0]}) to continue the run "
                              "exactly, or pass --allow_config_change to continue on this many (the result will not "
                              "match an unbroken run).")
        if diffs and not args.allow_config_change:
            raise ConfigError(f"resuming {resume!r} with flags that change the run: {describe_differences(diffs)}. "
                              "Use the checkpoint's values, or pass --allow_config_change to continue with the new "
                              "ones (the result will not match an unbroken run).")
        if ranks:
            log(f"warning: --allow_config_change: continuing {resume!r}, written by {ranks[0]} rank(s), on "
                f"{ranks[1]}")
        if diffs:
            log(f"warning: --allow_config_change: continuing {resume!r} with {describe_differences(diffs)}")
    except BaseException:
        lock.release()
        raise
    return lock, {"resume": resume, "seed": seed, "full_resume": full_resume}


def tool_plan(args):
    """The plan of a tool's setup (benchmarks, diagnostics): no output folder to claim."""
    resume = ckpt.resolve_resume_path(args.resume_from_checkpoint, args.output_dir) \
        if args.resume_from_checkpoint else None
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2 ** 31)
    return {"resume": resume, "seed": seed, "full_resume": bool(resume) and ckpt.checkpoint_problem(resume) is None}
