#!/usr/bin/env bash
# The deferred proxy's and the upstream adapter's tests, both tiers, in the environment a user has: a fresh
# venv with Flow-GRPO's pins (flowgrpo) or DanceGRPO's (dancegrpo), this project added with
# `pip install --no-deps -e .` as docs/flowgrpo.md says, plus the test runner. Tests that need a newer
# library than the environment holds skip, each with its reason.
#
#   scripts/user_env_check.sh flowgrpo|dancegrpo [VENV_FOLDER]   (default: /tmp/jagg-env-<name>)
#
# PyPI's torch wheels for Linux are CUDA builds (they run on a CPU, but import only beside their nvidia-*
# packages): about 3.5 GB of downloads and 5.5 GB in the venv, 2.5-3.5 min to build on a 2-core machine;
# the tests take about 3.5 min. A venv already built is reused. Last results: docs/deferred.md ("In the
# environments users have").
set -euo pipefail
cd "$(dirname "$0")/.."

case "${1:-}" in
  flowgrpo)   # Flow-GRPO's setup.py pins
    PINS=(torch==2.6.0 diffusers==0.33.1 transformers==4.40.0 accelerate==1.4.0 peft==0.10.0) ;;
  dancegrpo)  # DanceGRPO's pins (transformers: diffusers 0.32's contemporary, which DanceGRPO does not pin)
    PINS=(torch==2.5.0 diffusers==0.32.0 transformers==4.46.3 accelerate==1.0.1 peft==0.13.2) ;;
  *) echo "usage: $0 flowgrpo|dancegrpo [VENV_FOLDER]" >&2; exit 2 ;;
esac
VENV="${2:-/tmp/jagg-env-$1}"
# What the tests of these parts use beside the pins (no matplotlib, open-clip or DeepSpeed: a user's
# environment need not hold them).
TEST_DEPS=(absl-py ml-collections numpy pillow safetensors tqdm pytest pytest-xdist)

if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "${PINS[@]}" "${TEST_DEPS[@]}"
fi
"$VENV/bin/pip" install -q --no-deps -e .
"$VENV/bin/python" -c "import torch, diffusers, accelerate, peft; print('torch', torch.__version__, '| diffusers', \
diffusers.__version__, '| accelerate', accelerate.__version__, '| peft', peft.__version__)"
# Both tiers of those parts (-m ""): the launch lines under the environment's accelerate and torchrun too.
exec "$VENV/bin/python" -m pytest -q -n 2 -rs -m "" -p no:cacheprovider tests/patch/deferred tests/patch/upstream
