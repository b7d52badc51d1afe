"""What the pass-count cost model predicts for Flow-GRPO's SD3 recipe run through jagg_patch.deferred.

    python -m jagg_patch.tools.cost_flowgrpo

Flow-GRPO's scripts/train_sd3.py, per sample and epoch: a rollout of S steps on the doubled batch
[uncond; cond] (CFG), then the first T = int(S x timestep_fraction) steps trained in order, each a
doubled call with grad (the uncond half detached) and, with beta > 0, the same call without grad with
the adapter disabled (the KL reference). The accumulation makes two optimizer steps per epoch.

In units of F, one transformer forward of one row (a doubled call is 2 F), B the backward of one row's
forward:
    vanilla               S 2F  +  T (2F + 2B)                       +  T 2F (KL)
    deferred              S 2F  +  T 2F (the loop's calls, no grad)  +  replays  +  T 2F (KL)
    deferred + reuse      as deferred, the loop's calls of on-policy samples taken from the rollout
where the replays are, per JAGG group, its two endpoints' cond rows (F + B each: the uncond rows carry
no signal and are not replayed) and, per exact group, every member's cond row. The rollout's outputs
are on-policy only until the epoch's first optimizer step: half the samples of a two-step epoch.
Decoding, rewards, the optimizer and communication are left out.
"""
from dataclasses import dataclass

from ..plan import plan_groups
from .cost_model import SETTINGS, backward_units, sum_passes, table_command

# Flow-GRPO's SD3 recipe (config/grpo.py): 10 steps, timestep_fraction 0.99, CFG 4.5, beta 0.04 / 0.01,
# accumulation over half the epoch's batches
RECIPE = dict(steps=10, trained=9, cfg=True, kl=True, optimizer_steps=2)


@dataclass
class Passes:
    """One sample's epoch, in rows: forwards without grad (rollout, the loop's calls, KL), forwards with
    grad and backwards."""
    rollout: float
    nograd: float
    grad: float
    backward: float

    def units(self, b_over_f, checkpointing=0.0):
        return self.rollout + self.nograd + self.grad + self.backward * backward_units(b_over_f, checkpointing)

    def update_units(self, b_over_f, checkpointing=0.0):
        return self.units(b_over_f, checkpointing) - self.rollout


def flowgrpo_passes(window, jagg_frac, steps=10, trained=9, cfg=True, kl=True, optimizer_steps=2):
    """{mode: Passes} for vanilla, deferred and deferred + reuse at one window and jagg_frac."""
    rows = 2 if cfg else 1
    rollout = steps * rows
    kl_rows = trained * rows if kl else 0
    groups = plan_groups(range(trained), window, jagg_frac)
    replayed, called, _ = sum_passes(groups, schedule="deferred")
    on_policy = 1.0 / optimizer_steps   # the share of samples trained before the epoch's first optimizer step
    return {
        "vanilla": Passes(rollout, kl_rows, trained * rows, trained * rows),
        "deferred": Passes(rollout, called * rows + kl_rows, replayed, replayed),
        "deferred + reuse": Passes(rollout, (1 - on_policy) * called * rows + kl_rows, replayed, replayed),
    }


def flowgrpo_table(windows=((3, 1.0), (3, 0.6), (9, 1.0)), settings=SETTINGS, **recipe):
    recipe = {**RECIPE, **recipe}
    lines = [f"Flow-GRPO SD3 recipe: S {recipe['steps']}, T {recipe['trained']} trained, CFG {recipe['cfg']}, "
             f"KL {recipe['kl']}, {recipe['optimizer_steps']} optimizer steps per epoch",
             "", "| W, jagg_frac | mode | rows / sample (rollout, no-grad, grad, backward) | "
             + " | ".join(f"update / vanilla at {label} | step / vanilla at {label}" for label, _, _ in settings)
             + " |",
             "|---|---|---|" + "---|---|" * len(settings)]
    for window, jagg_frac in windows:
        passes = flowgrpo_passes(window, jagg_frac, **recipe)
        vanilla = passes["vanilla"]
        for mode, p in passes.items():
            ratios = " | ".join(f"{p.update_units(b, c) / vanilla.update_units(b, c):.3f} | "
                                f"{p.units(b, c) / vanilla.units(b, c):.3f}" for _, b, c in settings)
            counts = f"{p.rollout:g}, {p.nograd:g}, {p.grad:g}, {p.backward:g}"
            lines.append(f"| {window}, {jagg_frac} | {mode} | {counts} | {ratios} |")
    return "\n".join(lines)


def main(argv=None):
    table_command("python -m jagg_patch.tools.cost_flowgrpo", __doc__,
                  "It takes no arguments; the recipe is Flow-GRPO's SD3 recipe.", flowgrpo_table, argv)


if __name__ == "__main__":
    main()
