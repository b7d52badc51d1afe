import os

import pytest

from dancegrpo.args import parse_args


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: multi-run learning checks (~1 min); still run in CI")


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One preset cache for the whole session: presets are built once, offline."""
    return str(tmp_path_factory.mktemp("preset_cache"))


@pytest.fixture
def make_args(cache_dir, tmp_path):
    """Parse a trainer's command line the way `python -m ...` does, with presets applied."""
    def make(*argv, module="dancegrpo.train_grpo_flux", preset="tiny"):
        import importlib
        parser = importlib.import_module(module).build_parser()
        full = ["--cache_dir", cache_dir, "--output_dir", str(tmp_path / "run")]
        if preset:
            full += ["--preset", preset]
        return parse_args(parser, full + [str(a) for a in argv])
    return make


# Small, fast geometry on the tiny models: 2 prompts x 4 generations, one optimizer step.
FAST = ["--train_batch_size", 2, "--num_generations", 4, "--gradient_accumulation_steps", 8,
        "--sample_batch_size", 8, "--update_batch_size", 4]
