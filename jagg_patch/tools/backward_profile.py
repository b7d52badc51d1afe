"""Why one joint backward through two graphs costs more than two single backwards (an analysis tool).

    python -m jagg_patch.tools.backward_profile dancegrpo.train_grpo_qwenimage --preset small --output_dir runs/prof \\
        [--prof_reps 5] [--prof_top 12]

On one rollout and one micro-batch (--update_batch_size samples at two transitions), interleaved,
--prof_reps times, medians:
  B      one backward of one graph, parameter grads None before (AccumulateGrad takes the tensor)
  B_acc  the same with grads present (AccumulateGrad adds: every backward of the update but the first)
  split  two graphs, each backpropagated by its own call (grads None before)
  joint  two graphs, ONE call (grads None before): autograd first sums the two graphs' contributions
         to each parameter (one parameter-sized add), then AccumulateGrad
Then torch.profiler over one joint and one split backward: the ops whose self CPU time differs
most. bench_update's unit cost B is measured like B here and B2 like joint.
"""
import statistics
import sys
import time

import torch

from ..cli import check_trajectory, trainer_cli


def _timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(module, args):
    from dancegrpo import trainer
    from dancegrpo.errors import ConfigError
    ctx = trainer.setup(args, module.FAMILY(args))
    prepared = trainer.prepare_update(ctx, step=1)
    idx = torch.arange(args.update_batch_size, device=ctx.device)
    steps = prepared.selection.steps[idx][:, :2]   # two trained transitions per sample: the endpoints
    if steps.shape[1] < 2:
        raise ConfigError("jagg_patch.tools.backward_profile needs 2 trained transitions per sample; raise "
                          "--timestep_fraction or --sde_window_size")
    batch = trainer.make_update_batch(ctx, prepared.rollout, prepared.cond, prepared.advantages, idx, steps, 1)
    k0, k1 = steps[:, 0], steps[:, 1]
    model = ctx.transformer
    model.train()

    def clear():
        model.zero_grad(set_to_none=True)

    def one(v):
        torch.autograd.backward(v, torch.ones_like(v))

    def forms():
        clear()
        v = batch.predict(k0)
        b = _timed(lambda: one(v))
        v = batch.predict(k0)
        b_acc = _timed(lambda: one(v))
        clear()
        v0, v1 = batch.predict(k0), batch.predict(k1)
        split = _timed(lambda: (one(v0), one(v1)))
        clear()
        v0, v1 = batch.predict(k0), batch.predict(k1)
        joint = _timed(lambda: torch.autograd.backward([v0, v1], [torch.ones_like(v0), torch.ones_like(v1)]))
        return dict(B=b, B_acc=b_acc, split=split, joint=joint)

    forms()  # warm-up
    samples = [forms() for _ in range(args.prof_reps)]
    med = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
    profiles = {}
    for name in ("split", "joint"):
        clear()
        v0, v1 = batch.predict(k0), batch.predict(k1)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            if name == "split":
                one(v0)
                one(v1)
            else:
                torch.autograd.backward([v0, v1], [torch.ones_like(v0), torch.ones_like(v1)])
        profiles[name] = {e.key: (e.self_cpu_time_total / 1e6, e.count) for e in prof.key_averages()}
    clear()
    ctx.counter.remove()
    params = sum(p.numel() for p in ctx.raw_transformer.parameters() if p.requires_grad)
    return dict(family=ctx.family.name, params=params, micro_batch=len(idx), reps=args.prof_reps, medians=med,
                profiles=profiles)


def format_report(r, top=12):
    m = r["medians"]
    lines = [f"## Joint vs split backward: {r['family']} ({r['params'] / 1e6:.1f}M trainable params, micro-batch "
             f"{r['micro_batch']}, {r['reps']} reps, medians, {torch.get_num_threads()} threads)", "",
             "| form | ms | / B |", "|---|---|---|"]
    for k in ("B", "B_acc", "split", "joint"):
        lines.append(f"| {k} | {1e3 * m[k]:.1f} | {m[k] / m['B']:.2f} |")
    split, joint = r["profiles"]["split"], r["profiles"]["joint"]
    keys = sorted(set(split) | set(joint),
                  key=lambda k: -abs(joint.get(k, (0, 0))[0] - split.get(k, (0, 0))[0]))[:top]
    lines += ["", "| op (self CPU) | split ms | joint ms | joint - split ms | calls split / joint |",
              "|---|---|---|---|---|"]
    for k in keys:
        (s, sc), (j, jc) = split.get(k, (0.0, 0)), joint.get(k, (0.0, 0))
        lines.append(f"| {k} | {1e3 * s:.1f} | {1e3 * j:.1f} | {1e3 * (j - s):+.1f} | {sc} / {jc} |")
    return "\n".join(lines)


def add_profile_args(parser):
    parser.add_argument("--prof_reps", type=int, default=5)
    parser.add_argument("--prof_top", type=int, default=12)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    module, parser, rest = trainer_cli(argv, "jagg_patch.tools.backward_profile", __doc__, add_profile_args)
    from dancegrpo.args import parse_args
    from dancegrpo.errors import exit_on_config_error
    args = parse_args(parser, rest)
    check_trajectory(args)
    result = exit_on_config_error(measure)(module, args)
    print(format_report(result, args.prof_top), flush=True)
    return result


if __name__ == "__main__":
    main()
