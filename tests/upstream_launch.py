"""`python -m jagg_patch.upstream ARGS`, with the stand-ins as known releases (as the tests' standins_known
fixture makes them), so that the restated step runs them: `python tests/upstream_launch.py ARGS`."""
import importlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

if __name__ == "__main__":
    from upstream_harness import standin_releases
    fingerprint_module = importlib.import_module("jagg_patch.upstream.fingerprint")
    fingerprint_module.UPSTREAM_RELEASES = fingerprint_module.UPSTREAM_RELEASES + standin_releases()
    from dancegrpo.errors import exit_on_config_error
    from jagg_patch.upstream.__main__ import main
    exit_on_config_error(main)()
