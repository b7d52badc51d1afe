"""jagg_patch.deferred on a real diffusers model (a tiny FluxTransformer2DModel), rows of several
calls replayed together: img_ids / txt_ids shared by every row even where the text length equals the
batch (ARGUMENT_ROLES), gradient checkpointing, a peft LoRA adapter with reference calls through
disable_adapters(), and bf16 autocast. W 2 is the exact gradient, so the deferred update must give
the loop's own gradient (float64: to 1e-12)."""
import pytest
import torch

from deferred_loops import Log, Setting, capture_grads, flux_model_loop, tiny_flux
from helpers import relative_error
from jagg_patch import JaggConfig
from jagg_patch import deferred
from jagg_patch.deferred.calls import SHARED, Call, CallShape

SETTING = Setting(prompts=2, generations=2, steps=5, trained=3, batch=2, accumulation=4, text_tokens=2)


def grads(model, config, deferred_on, **loop):
    """The gradient at the optimizer step of the loop, with or without the proxy; the proxy."""
    proxy = deferred.wrap(model, config) if deferred_on else model
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    if deferred_on:
        proxy.attach(optimizer)
    log = Log()
    capture_grads(optimizer, [p for p in model.parameters() if p.requires_grad], log)
    try:
        flux_model_loop(proxy, optimizer, SETTING, log, torch.Generator().manual_seed(0), **loop)
    finally:
        if deferred_on:
            proxy.close()
    return log.grads[0], proxy


def test_txt_ids_are_shared_even_when_the_text_is_as_long_as_the_batch():
    model = tiny_flux()
    x = torch.zeros(2, 16, 64, dtype=torch.float64)
    call = Call.bind(CallShape.of(model), (), dict(hidden_states=x, encoder_hidden_states=torch.zeros(2, 2, 32),
                                                    pooled_projections=torch.zeros(2, 32), timestep=torch.zeros(2),
                                                    img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(2, 3),
                                                    guidance=torch.zeros(2)), False)
    assert call.roles["txt_ids"] == SHARED and call.roles["img_ids"] == SHARED and call.splittable


@pytest.mark.parametrize("checkpointing", [False, True])
def test_w2_is_the_loops_own_gradient(checkpointing):
    """Endpoints of other calls replayed together (chunks of 2 rows from different calls)."""
    model = tiny_flux()
    if checkpointing:
        model.enable_gradient_checkpointing()
    plain, _ = grads(model, JaggConfig(), False)
    got, proxy = grads(model, JaggConfig(window=2, jagg_frac=1.0), True)
    assert relative_error(got, plain) < 1e-12
    stats = proxy.stats[0]
    assert stats.jagg_groups > 0 and stats.exact_rows == stats.rows_exact.get("routed exact", 0)
    assert stats.forwards_grad == stats.rows_deferred   # W 2 replays every row: each group's two in one chunk


def test_lora_with_reference_calls():
    from peft import LoraConfig
    model = tiny_flux()
    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian",
                                 target_modules=["to_k", "to_q", "to_v", "to_out.0"]))
    plain, _ = grads(model, JaggConfig(), False, kl=True)
    got, proxy = grads(model, JaggConfig(window=2, jagg_frac=1.0), True, kl=True)
    assert relative_error(got, plain) < 1e-12
    assert proxy.stats[0].rollout_rows == SETTING.samples * SETTING.steps   # the reference calls: not a rollout


def test_bf16_autocast():
    """A GPU's dtype path: float32 weights under bf16 autocast. The replay runs other batches than the
    calls did: within the guard's bound (on CPU even bit for bit), and near the loop's own gradient
    (the signals are bf16, as vanilla's; their fold is summed in float32)."""
    model = tiny_flux(torch.float32)
    autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)   # noqa: E731
    plain, _ = grads(model, JaggConfig(), False, autocast=autocast)
    got, proxy = grads(model, JaggConfig(window=2, jagg_frac=1.0), True, autocast=autocast)
    stats = proxy.stats[0]
    assert stats.max_replay_diff <= stats.replay_bound and stats.forwards_grad == stats.rows_deferred
    print("bf16 relative error", relative_error(got, plain))
    assert relative_error(got, plain) < 1e-2


def _fingerprint_by_hand(row, weights):
    """A row's fingerprint written out: its values' float64 bits as Python integers, the sums taken
    modulo 2^64 and read back as signed."""
    bits = [int(b) for b in row.detach().reshape(-1).to(torch.float64).numpy().view("int64")]
    signed = lambda v: (v + 2 ** 63) % 2 ** 64 - 2 ** 63   # noqa: E731
    return [signed(sum(bits)), *(signed(sum(b * int(w) for b, w in zip(bits, ws))) for ws in weights)]


def test_a_rows_fingerprint_is_its_values_whatever_batch_offset_or_dtype():
    from jagg_patch.deferred.calls import _weights, row_fingerprints
    g = torch.Generator().manual_seed(3)
    batch = torch.randn(9, 3, 4, 5, generator=g) * 1e3
    prints = row_fingerprints(batch)
    weights = _weights(60, "cpu")
    assert prints[4].tolist() == _fingerprint_by_hand(batch[4], weights)
    # one row alone, a strided view, the rows in another batch: the same fingerprints
    assert row_fingerprints(batch[4:5].clone())[0].tolist() == prints[4].tolist()
    assert row_fingerprints(batch[1::3])[1].tolist() == prints[4].tolist()
    assert row_fingerprints(torch.cat([batch[7:], batch[:2]]))[3].tolist() == prints[1].tolist()
    # the same values in another dtype: bf16, and those values cast up to float32 / float64
    low = batch.to(torch.bfloat16)
    assert row_fingerprints(low).tolist() == row_fingerprints(low.float()).tolist() \
        == row_fingerprints(low.double()).tolist()
    assert row_fingerprints(low)[2].tolist() == _fingerprint_by_hand(low[2], weights)
    # one value changed by one ulp changes every part of that row's fingerprint, and no other row's
    moved = batch.clone()
    moved[6, 2, 3, 1] = torch.nextafter(moved[6, 2, 3, 1], torch.tensor(float("inf")))
    changed = row_fingerprints(moved)
    assert all(a != b for a, b in zip(changed[6].tolist(), prints[6].tolist()))
    assert torch.equal(torch.cat([changed[:6], changed[7:]]), torch.cat([prints[:6], prints[7:]]))
