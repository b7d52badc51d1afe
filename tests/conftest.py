import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: minutes-long learning runs; run with DANCEGRPO_SLOW=1")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("DANCEGRPO_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow learning run; set DANCEGRPO_SLOW=1 to run it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def preset_cache(tmp_path_factory):
    """One preset cache for the session, so each preset is built once."""
    return str(tmp_path_factory.mktemp("preset_cache"))
