import json
import os
import sys

import pytest
import torch

from dancegrpo.args import parse_args

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # test helper modules

# One thread per process, here and in every process a test starts: the models are tiny, two threads
# on a 2-core machine shared with the test's other processes cost more than they give (measured on
# a third of the suite: 231 s with the default threads, 208 s with one), and runs compared bit for
# bit between this process and a subprocess then reduce in the same order.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: the slow tier (learning checks, script smokes, kill-resume loops, "
                                       "multi-rank runs), left out unless `-m slow` (or `-m \"\"`) is given; "
                                       ".ci/run runs it after the fast tier")
    # Set on the units below; pytest-xdist registers it too, where it runs.
    config.addinivalue_line("markers", "xdist_group(name): a work unit that stays on one worker under -n")
    # With workers (-n N): whole work units (loadgroup), in the order given below (no reordering). These
    # are pytest-xdist's options, so they are set here, only where it runs, and not in pyproject's
    # addopts, where `pytest -p no:xdist` stops at them as unknown flags. A --dist given by hand wins.
    if any(str(a).startswith("--dist") for a in config.invocation_params.args):
        return
    if getattr(config.option, "numprocesses", None):   # the controller: how it hands out the units
        config.option.dist = "loadgroup"
        config.option.loadscopereorder = False
    elif hasattr(config, "workerinput"):   # a worker: names each test's unit in its node id, as loadgroup needs
        config.option.loadgroup = True


# Under pytest-xdist (`-n 2 --dist loadgroup`, as the README runs the suite) a work unit goes to one
# worker. Tests that share an expensive start stay in one unit, or each worker would pay for it: the
# users of a module-scoped fixture (one per module: the DeepSpeed runs, the benchmark scripts side by
# side, the upstream stand-in's process group) and every two-rank check (one torchrun launch for all
# of them). The units holding a slow test go first: they are the long poles.
DIST_GROUP = "two_rank_checks"


def _work_unit(item):
    if "dist_result" in item.fixturenames:
        return DIST_GROUP
    defs = getattr(item, "_fixtureinfo", None)
    for fixturedefs in (defs.name2fixturedefs.values() if defs else ()):
        if any(d.scope == "module" for d in fixturedefs):
            return item.nodeid.split("::")[0]
    return None


def _dist_spec(item):
    return item.callspec.params.get("dist_result") if hasattr(item, "callspec") else None


def _skipped(item):
    """Whether a skip mark (or a skipif whose condition is true) leaves the test out: its two-rank check
    is then left out of the launch."""
    return bool(item.get_closest_marker("skip")) or any(m.args and m.args[0] is True
                                                        for m in item.iter_markers("skipif"))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    from helpers import missing_cpu_fsdp2
    no_fsdp2 = missing_cpu_fsdp2()
    units = {}
    for item in items:
        spec = _dist_spec(item)
        if no_fsdp2 and spec is not None and "fsdp2" in spec[2]:
            item.add_marker(pytest.mark.skip(reason=no_fsdp2))   # and left out of the two-rank launch
        unit = _work_unit(item)
        if unit is not None:
            item.add_marker(pytest.mark.xdist_group(unit))
        units.setdefault(unit or item.nodeid, []).append(item)
    slow = {key for key, members in units.items()
            if key == DIST_GROUP or any(m.get_closest_marker("slow") for m in members)}
    order = {key: (key not in slow, i) for i, key in enumerate(units)}
    items[:] = [m for key in sorted(units, key=order.get) for m in units[key]]


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




@pytest.fixture(scope="session")
def tiny_hps(tmp_path_factory):
    """(ckpt_dir holding HPS_v2.1_compressed.pt, path of the open_clip config JSON)."""
    import open_clip
    from tiny_models import TINY_OPEN_CLIP
    root = tmp_path_factory.mktemp("hps")
    config = root / "tiny-hps-clip.json"
    config.write_text(json.dumps(TINY_OPEN_CLIP))
    open_clip.add_model_config(str(config))
    torch.manual_seed(0)
    model = open_clip.create_model("tiny-hps-clip", pretrained=None)
    ckpt = root / "hps_ckpt"
    ckpt.mkdir()
    torch.save({"state_dict": model.state_dict()}, ckpt / "HPS_v2.1_compressed.pt")
    return str(ckpt), str(config)


@pytest.fixture(scope="session")
def tiny_hf_clip(tmp_path_factory):
    from tiny_models import build_tiny_hf_clip
    root = tmp_path_factory.mktemp("hfclip")
    return build_tiny_hf_clip(str(root), with_processor_in_model=True)


@pytest.fixture(scope="session")
def preset_cache(cache_dir):
    """Alias used by the Qwen-Image and preprocessing tests."""
    return cache_dir


@pytest.fixture(scope="session")
def dist_checks(request, cache_dir, tmp_path_factory):
    """The two-rank checks of every selected test (its `dist_result` parameter, see
    helpers.dist_check), run in ONE torchrun launch of tests/dist/run_checks.py on first use."""
    from helpers import DistChecks
    specs = {}
    for item in request.session.items:
        spec = _dist_spec(item)
        if spec is not None and not _skipped(item):
            name = spec[0]
            assert specs.setdefault(name, spec) == spec, f"two different two-rank checks are named {name}"
    return DistChecks(list(specs.values()), cache_dir, tmp_path_factory.mktemp("dist_checks"))


@pytest.fixture
def dist_result(request, dist_checks):
    """This test's two-rank check result (rank 0's JSON)."""
    return dist_checks.result(request.param[0])
