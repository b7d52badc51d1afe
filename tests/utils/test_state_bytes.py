"""The analytic per-rank training-state bytes (dancegrpo.utils.state_bytes) against numbers worked out
by hand, and the trainer's start-up line that states them."""
import pytest

from dancegrpo.utils.state_bytes import per_rank_bytes


@pytest.mark.parametrize("setup,world,weight_type,expected", [
    # P = 1000 parameters, T trainable; AdamW: two moments per trainable parameter.
    ("fsdp", 4, "fp32", dict(params=1000 * 4 / 4, grads=1000 * 4 / 4, optimizer=2 * 1000 * 4 / 4)),
    ("fsdp", 2, "bf16", dict(params=1000, grads=1000, optimizer=2000)),
    ("lora", 4, "fp32", dict(params=1000, grads=10, optimizer=20)),            # T = 10 adapter parameters
    ("zero2", 4, "bf16", dict(params=2000, grads=500, optimizer=3000)),       # 12 bytes / trainable / 4 ranks
    ("zero3", 4, "bf16", dict(params=500, grads=500, optimizer=3000)),
    ("zero2", 4, "fp32", dict(params=4000, grads=1000, optimizer=3000)),      # fp32 (CPU): 4 B params and grads
    ("zero0", 1, "fp32", dict(params=4000, grads=4000, optimizer=8000)),      # no master copy: two moments
    ("zero0", 1, "bf16", dict(params=2000, grads=2000, optimizer=12000)),
])
def test_per_rank_bytes_by_hand(setup, world, weight_type, expected):
    trainable = 10 if setup == "lora" else 1000
    got = per_rank_bytes(setup, 1000, trainable, world, weight_type)
    assert {k: got[k] for k in expected} == expected
    assert got["total"] == sum(expected.values())
    with pytest.raises(ValueError, match="unknown setup"):
        per_rank_bytes("zero4", 1, 1, 1)


def test_startup_line_states_the_training_state(make_args, capsys):
    from helpers import FAST
    from dancegrpo import train_grpo_flux
    train_grpo_flux.main(make_args(*FAST, "--max_train_steps", 1, "--use_lora", "--lora_rank", 4, "--lora_alpha", 8))
    line = next(li for li in capsys.readouterr().out.splitlines() if li.startswith("training state:"))
    # 1792 adapter parameters (rank 4 on the tiny model's 7 adapted Linears), fp32, one rank:
    # grads 1792 x 4 B = 0.007 MiB, moments 2 x that; params 83456 (base + adapter) x 4 B = 0.318 MiB
    assert "params 0.318 MiB + grads 0.007 MiB + optimizer 0.014 MiB" in line
