"""Every test of the patch leaves dancegrpo's trainers unpatched, whatever it applied."""
import pytest


@pytest.fixture(autouse=True)
def always_reverted():
    yield
    from jagg_patch import revert_jagg
    revert_jagg()
