#!/usr/bin/env bash
# Refreshes requirements-lock.txt: the exact versions, with their hashes, of everything the README's commands and CI
# install (the package's dependencies and its test extra, which holds the serve, plots and tpu extras), resolved
# from pyproject.toml by pip-tools for this Python (the lock's header names it).
#   bash scripts/lock.sh                  # after changing a dependency in pyproject.toml
#   bash scripts/lock.sh --upgrade        # every pin to the newest release its range allows
# The lock's torch is the CPU build the machines of this project find beside PyPI (torch==2.13.0+cpu); on another
# machine install with `pip install -e ".[test]"` instead, which resolves afresh.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tools="$(mktemp -d)"
trap 'rm -rf "$tools"' EXIT
"${PYTHON:-python3}" -m venv "$tools/venv"
"$tools/venv/bin/python" -m pip install -q --disable-pip-version-check "pip-tools>=7.4,<8"
cd "$root"
"$tools/venv/bin/pip-compile" -q --extra test --generate-hashes --strip-extras --unsafe-package glm-jax \
  --no-emit-index-url --no-emit-find-links --output-file requirements-lock.txt "$@" pyproject.toml
echo "wrote $root/requirements-lock.txt"
