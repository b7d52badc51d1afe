"""JAGG under bf16 autocast (--mixed_precision bf16 on CPU, a GPU's numerics class): its group gradient
against the float32 one of the same groups, within the error bf16 gives the exact per-step gradient on
the same rollout (measured here, not assumed), for every backward form, with and without the
rollout's outputs; and the fold of the upstream gradients, rounded once."""
import pytest
import torch

import dancegrpo.train_grpo_flux as flux
from dancegrpo import trainer
from dancegrpo.algo.grpo import policy_update as vanilla_update
from dancegrpo.algo.rollout import predict_velocity
from jagg_patch import make_policy_update
from jagg_patch.core import fold_signals

from helpers import FAST, relative_error

W = 4   # the tiny preset trains 4 transitions per sample: one group of 4 (2 middles)


@pytest.fixture(scope="module")
def bf16_setup(tmp_path_factory):
    """A float32 rollout of the tiny preset and a function giving the update's gradient in a precision.
    The PPO clip is left open (--clip_range 1e6): what is compared is the gradient's arithmetic, not
    which transitions a precision happens to clip."""
    from dancegrpo.args import parse_args
    cache = str(tmp_path_factory.mktemp("bf16_cache"))
    args = parse_args(flux.build_parser(), ["--preset", "tiny", "--cache_dir", cache, "--output_dir",
                                            str(tmp_path_factory.mktemp("bf16_run")), *map(str, FAST),
                                            "--clip_range", "1e6"])
    ctx = trainer.setup(args, flux.FAMILY(args))
    prepared = trainer.prepare_update(ctx, step=1)
    rollout, cond, adv = prepared.rollout, prepared.cond, prepared.advantages
    n, idx = adv.numel(), torch.arange(adv.numel())

    def outputs():   # what a rollout in this precision keeps: one forward over all samples per transition
        with torch.no_grad():
            return torch.stack([predict_velocity(ctx, rollout.latents[:, k], ctx.timesteps[k].expand(n), cond)
                                for k in range(args.sampling_steps)], dim=1)

    def gradient(precision, update, reuse=False):
        ctx.args.mixed_precision = precision
        rollout.outputs = outputs() if reuse else None
        ctx.transformer.zero_grad(set_to_none=True)
        ctx.transformer.train()
        trainer.accumulate_policy_gradient(ctx, rollout, cond, adv, idx, prepared.selection.steps,
                                           prepared.normaliser, update, on_policy=True)
        return [p.grad.clone() for p in ctx.raw_transformer.parameters()], rollout.outputs

    yield gradient
    ctx.counter.remove()


@pytest.mark.parametrize("backward", ["joint", "split", "batched"])
@pytest.mark.parametrize("reuse", ["off", "on_policy"])
def test_bf16_jagg_group_gradient_is_within_bf16s_own_error(bf16_setup, backward, reuse):
    exact32, _ = bf16_setup(None, vanilla_update)
    exact16, _ = bf16_setup("bf16", vanilla_update)
    bf16_error = relative_error(exact16, exact32)
    assert bf16_error > 1e-3, "bf16 did not change the exact gradient: the run did not compute in bf16"
    assert all(g.dtype == torch.float32 for g in exact16)   # the master weights' gradients stay float32
    update = make_policy_update(window=W, jagg_frac=1.0, backward=backward, reuse=reuse)
    jagg32, outputs32 = bf16_setup(None, update, reuse != "off")
    jagg16, outputs16 = bf16_setup("bf16", update, reuse != "off")
    if reuse != "off":   # the kept outputs are the model's own: bf16 under autocast
        assert (outputs32.dtype, outputs16.dtype) == (torch.float32, torch.bfloat16)
    # Measured on the tiny preset: bf16 moves the exact gradient by 0.104 and JAGG's by 0.101 (W 4: JAGG
    # is itself 0.099 off the exact gradient in float32): JAGG adds no error of its own to bf16's.
    assert relative_error(jagg16, jagg32) <= 1.5 * bf16_error


def test_the_fold_of_bf16_upstream_gradients_is_rounded_once():
    """s_base / s_corr from bf16 s_j: the float64 fold rounded once to bf16 (within half a bf16 ulp per
    element), where folding in bf16 (alpha and every partial sum rounded) is measurably worse."""
    g = torch.Generator().manual_seed(0)
    width = 8
    alpha = torch.tensor([j / (width - 1) for j in range(width)], dtype=torch.float64) ** 1.3
    weights = [(1 - a, a) for a in alpha]
    upstream = {j: torch.randn(64, 256, generator=g).to(torch.bfloat16) for j in range(width)}
    for end in (0, 1):
        exact = sum(float(weights[j][end]) * s.double() for j, s in upstream.items())
        folded = fold_signals(weights, upstream, end)
        assert folded.dtype == torch.bfloat16
        assert relative_error(folded, exact) <= 2 ** -9
        naive = sum(weights[j][end].to(torch.bfloat16) * s for j, s in upstream.items())
        assert relative_error(naive, exact) > 1.5 * relative_error(folded, exact)
