"""dancegrpo.utils.activation_meter: the saved-for-backward meter against bytes counted by hand, and the
activation-peak metric of a training step."""
import pytest
import torch

import dancegrpo.train_grpo_flux as flux
from helpers import FAST
from dancegrpo import trainer
from dancegrpo.utils.activation_meter import ActivationMeter


def test_activation_meter_counts_by_hand():
    x = torch.randn(1000, dtype=torch.float64, requires_grad=True)
    b = torch.randn(250, 4, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(4))
    with ActivationMeter() as meter:
        y = x.exp()                  # saves its result: 8000 bytes
        z = b * w                    # saves b (4000 bytes) and the parameter w (not counted)
        q = x * x                    # saves x twice: one storage, 8000 bytes
    assert meter.peak_bytes == 8000 + 4000 + 8000
    (y.sum() + z.sum() + q.sum()).backward()
    assert meter.live_bytes == 0 and meter.peak_bytes == 20000
    meter.reset()
    assert meter.peak_bytes == 0


def test_meter_releases_what_it_counted():
    """Freed graphs leave the count (the meter must not keep them alive: an op's saved output
    would otherwise hold its own graph)."""
    x = torch.randn(100, requires_grad=True)
    with ActivationMeter() as meter:
        y = x.exp().sin()
    assert meter.live_bytes > 0
    del y
    assert meter.live_bytes == 0 and meter.peak_bytes > 0


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def test_training_step_reports_activation_peak(make_args):
    args = make_args(*FAST, "--max_train_steps", 1)
    ctx = trainer.setup(args, flux.FAMILY(args))
    ctx.step = 1
    record = flux.train_one_step(ctx)
    ctx.counter.remove()
    assert record["activation_peak_mb"] > 0
    assert ctx.activation_meter.live_bytes == 0            # every graph of the update was freed
    assert "cuda_peak_mb" not in record                    # CPU run
