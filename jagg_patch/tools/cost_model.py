"""The pass-count cost model of the policy update, and what the paper's speed figures imply.

    python -m jagg_patch.tools.cost_model

Per sample, the update costs F_g x (forwards with grad) + F_ng x (forwards without grad)
+ B x (backwards of one forward's graph). Per group of w members:

    exact per-step             w F_g              + w B
    this project's JAGG        2 F_g + (w-2) F_ng + 2 B   (joint or split backward)
    the authors' pass schedule 2 F_g +  w    F_ng + 2 B   (their code first forwards every
                                                          member without grad, endpoints too)
    with the rollout's outputs 2 F_g                + 2 B   (--jagg_reuse_rollout, on-policy
                                                          samples: the middles cost nothing)
    deferred (jagg_patch.deferred) 2 F_g +  w    F_ng + 2 B   (the loop's own calls without grad, then the
                                                          endpoints replayed; exact groups w (F_ng + F_g + B))
    deferred, rollout's outputs    2 F_g                + 2 B   (on-policy calls take the rollout's output;
                                                          exact groups w (F_g + B))

The table printed by `main` takes the paper's two speed figures and solves, for each
variant, the backward/forward cost ratio B/F at which the variant would be that much faster
per step than vanilla, with F_ng = F_g = F and a rollout of exactly S forwards. Decoding,
rewards, the optimizer and communication are left out: they only lower every gain, so they
can only raise the B/F a variant needs. A plain backward costs about 2 F. Gradient checkpointing
(the upstream recipes' --gradient_checkpointing) recomputes each checkpointed block's forward inside
the backward: B becomes B + p F, p the fraction of blocks recomputed (--selective_checkpointing, 1 by
default), so a backward costs about 3 F and every pass JAGG saves is worth more (`backward_units`).
"""
from dataclasses import dataclass

from dancegrpo.utils.command_line import CommandParser

from ..plan import group_cost, num_trained_windows, plan_groups, plan_windows


def group_passes(group, mode="jagg", schedule="project"):
    """(grad forwards, no-grad forwards, backwards) of one group of one sample. schedule: "project"
    (this project's restated update), "reuse" (its middles from the rollout), "authors" (the authors'
    pass schedule), "deferred" / "deferred_reuse" (jagg_patch.deferred: every member called without
    grad when the loop calls it, or taken from the rollout, then the replays)."""
    if schedule.startswith("deferred"):
        called = 0 if schedule == "deferred_reuse" else group.size
        replayed = 2 if group.jagg and mode != "exact" else group.size
        return replayed, called, replayed
    f_grad, f_nograd, backwards = group_cost(group, mode, reused=schedule == "reuse")
    if schedule == "authors" and group.jagg and mode != "exact":
        f_nograd += 2  # the endpoints' no-grad forwards for the upstream gradients
    return f_grad, f_nograd, backwards


def sum_passes(groups, mode="jagg", schedule="project"):
    totals = [0, 0, 0]
    for g in groups:
        for i, n in enumerate(group_passes(g, mode, schedule)):
            totals[i] += n
    return tuple(totals)


def seconds(passes, f_grad, f_nograd, backward):
    return passes[0] * f_grad + passes[1] * f_nograd + passes[2] * backward


def sample_groups(steps_row, num_transitions, window, jagg_frac, grouping="trained"):
    """The groups one sample's update runs: its trained transitions (-1 pads train nothing) grouped
    as the patched policy_update groups them (members: positions in its sorted transitions under the
    trained grouping, transitions under the window grouping)."""
    import torch   # here, not at import: the command answers --help and a flag error first
    from ..update import groups_of
    steps = torch.as_tensor([int(k) for k in steps_row], dtype=torch.long).reshape(1, -1)
    return [found.group for found in groups_of(steps, num_transitions, window, jagg_frac, grouping)]


def backward_units(b_over_f, checkpointing=0.0):
    """One backward in units of F: a plain backward's B/F plus the forward that gradient checkpointing
    recomputes in it (checkpointing: the fraction of blocks recomputed, 0 without it)."""
    return b_over_f + checkpointing


@dataclass
class Variant:
    """One sample's step in units of F (F_ng = F_g = F): rollout forwards + update passes."""
    label: str
    rollout_forwards: int
    passes: tuple      # (grad forwards, no-grad forwards, backwards)

    def units(self, b_over_f, checkpointing=0.0):
        return (self.rollout_forwards + self.passes[0] + self.passes[1]
                + self.passes[2] * backward_units(b_over_f, checkpointing))


def step_gain(b_over_f, vanilla, variant, checkpointing=0.0):
    return 1.0 - variant.units(b_over_f, checkpointing) / vanilla.units(b_over_f, checkpointing)


def implied_b_over_f(gain, vanilla, variant):
    """The B/F at which `variant` is `gain` faster per step than `vanilla` (None if no B/F does)."""
    slope = variant.passes[2] - (1 - gain) * vanilla.passes[2]
    if slope == 0:
        return None
    x = ((1 - gain) * (vanilla.units(0)) - variant.units(0)) / slope
    return x if x > 0 else None


def dancegrpo_variants(sampling_steps, timestep_fraction, window, jagg_frac, authors_sampling_steps=None,
                       authors_window=None):
    """vanilla and the JAGG variants at one upstream geometry (per sample)."""
    from dancegrpo.algo.grpo import num_train_timesteps
    n = num_train_timesteps(sampling_steps - 1, timestep_fraction)
    vanilla = Variant("vanilla DanceGRPO", sampling_steps, (n, 0, n))
    trained = plan_groups(range(n), window, jagg_frac)
    variants = [Variant(f"paper: trained grouping, W {window}, jagg_frac {jagg_frac} (this project's passes)",
                        sampling_steps, sum_passes(trained)),
                Variant("same groups, the authors' pass schedule", sampling_steps,
                        sum_passes(trained, schedule="authors")),
                Variant("rollout reuse: same groups, middles from the rollout (on-policy samples)", sampling_steps,
                        sum_passes(trained, schedule="reuse"))]
    if authors_sampling_steps:
        s, w = authors_sampling_steps, authors_window
        windows = plan_windows(s - 1, w, 1.0)   # their code needs W | S-1: equal windows, any k alike
        k = num_trained_windows(len(windows), timestep_fraction)
        variants.append(Variant(f"authors' code: S {s}, windows of {w}, {k} trained, all JAGG", s,
                                sum_passes(windows[:k], schedule="authors")))
    return vanilla, variants


# The paper's speed figures (s / training step) and the geometry each was measured at.
PAPER_FIGURES = (
    dict(model="Flux", baseline_s=279.0, jagg_s=228.0, sampling_steps=16, authors_sampling_steps=16,
         authors_window=5),   # 15 transitions: W 5 is the only window >= 4 their code accepts
    dict(model="Qwen-Image", baseline_s=835.0, jagg_s=691.0, sampling_steps=20, authors_sampling_steps=21,
         authors_window=4),   # run_jagg.sh (S 21, W 4) against run_standard.sh (S 20)
)


# (label, plain backward B/F, the fraction of blocks gradient checkpointing recomputes)
SETTINGS = (("B = 2 F", 2.0, 0.0), ("B = 2 F + F recomputed (gradient checkpointing)", 2.0, 1.0))


def paper_table(timestep_fraction=0.6, window=4, jagg_frac=0.6, settings=SETTINGS):
    rows = []
    for fig in PAPER_FIGURES:
        gain = 1 - fig["jagg_s"] / fig["baseline_s"]
        vanilla, variants = dancegrpo_variants(fig["sampling_steps"], timestep_fraction, window, jagg_frac,
                                               fig["authors_sampling_steps"], fig["authors_window"])
        for v in variants:
            rows.append(dict(model=fig["model"], paper_gain=gain, variant=v.label, passes=v.passes,
                             implied_b_over_f=implied_b_over_f(gain, vanilla, v),
                             predicted={label: step_gain(b, vanilla, v, p) for label, b, p in settings}))
    return rows


def format_table(rows, settings=SETTINGS):
    lines = ["| model (paper gain) | variant | passes / sample (F_g, F_ng, B) | B/F needed | "
             + " | ".join(f"gain at {label}" for label, _, _ in settings) + " |",
             "|---|---|---|---|" + "---|" * len(settings)]
    for r in rows:
        need = "none" if r["implied_b_over_f"] is None else f"{r['implied_b_over_f']:.2f}"
        lines.append(f"| {r['model']} ({100 * r['paper_gain']:.1f}%) | {r['variant']} | {r['passes']} | {need} | "
                     + " | ".join(f"{100 * r['predicted'][label]:+.1f}%" for label, _, _ in settings) + " |")
    return "\n".join(lines)


def table_command(prog, doc, epilog, table, argv=None):
    """A command that takes no argument (any given, a typo or a flag of another tool, is an error, not
    ignored) and prints its module's docstring after the first paragraph, then `table()`."""
    parser = CommandParser(prog=prog, description=doc.split("\n\n")[0], epilog=epilog)
    parser.parse_args(argv)
    print(doc.split("\n\n", 2)[2].strip())
    print()
    print(table())


def main(argv=None):
    table_command("python -m jagg_patch.tools.cost_model", __doc__,
                  "It takes no arguments; the model's settings are the paper's.",
                  lambda: format_table(paper_table()), argv)


if __name__ == "__main__":
    main()
