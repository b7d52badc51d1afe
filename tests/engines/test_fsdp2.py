"""--engine fsdp2's choices, refused at parse time in one line; its one-process run is the plain model
(the two-rank checks are in test_distributed.py and test_sharded_checkpoint.py)."""
import pytest

from helpers import FAST


@pytest.mark.parametrize("flags,message", [
    (["--fsdp_sharding_startegy", "none"], "none has no FSDP2 form"),
    (["--deepspeed_config", "x.json"], "add --engine deepspeed")])
def test_what_fsdp2_cannot_map_is_refused_at_parse_time(make_args, capsys, flags, message):
    with pytest.raises(SystemExit) as stop:
        make_args("--engine", "fsdp2", *flags)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and message in err.splitlines()[0] and "Traceback" not in err


@pytest.mark.parametrize("flag", ["--fsdp_sharding_strategy", "--fsdp_sharding_startegy"])
def test_the_sharding_error_names_the_flag_as_it_was_typed(make_args, capsys, flag):
    """The flag has upstream's misspelt name and the right one: the error says the one the user wrote."""
    with pytest.raises(SystemExit):
        make_args("--engine", "fsdp2", flag, "none")
    first = capsys.readouterr().err.splitlines()[0]
    assert f"{flag} none has no FSDP2 form" in first, first


@pytest.mark.parametrize("engine", ["fsdp", "fsdp2"])
def test_cpu_offload_without_a_gpu_is_one_line_at_parse_time(make_args, capsys, engine):
    """FSDP1 failed at the first forward of a CPU run with it; both engines now answer at the parse."""
    with pytest.raises(SystemExit) as stop:
        make_args("--engine", engine, "--use_cpu_offload")
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "--use_cpu_offload with --engine " + engine in err.splitlines()[0]
    assert "drop the flag" in err and "Traceback" not in err


def test_one_process_fsdp2_is_the_plain_model(make_args):
    from dancegrpo import train_grpo_flux
    from dancegrpo.engines import FSDP2Engine
    from dancegrpo.trainer import setup
    args = make_args(*FAST, "--engine", "fsdp2", "--max_train_steps", 1)
    ctx = setup(args, train_grpo_flux.FAMILY(args), plan=None)
    assert isinstance(ctx.engine, FSDP2Engine) and ctx.engine.label() == ""
    assert type(ctx.transformer).__name__ == "FluxTransformer2DModel"   # no fully_shard in one process
