#!/usr/bin/env bash
# Refreshes requirements-lock.txt: the exact versions, with their hashes, of everything the README's commands and CI
# install (the package's dependencies and its test extra, which holds the serve, plots and tpu extras), resolved
# from pyproject.toml by pip-tools for Python 3.12 (scripts/find_python.sh; the lock's header names it).
#   bash scripts/lock.sh                  # after changing a dependency in pyproject.toml
#   bash scripts/lock.sh --upgrade        # every pin to the newest release its range allows
# The lock's torch is PyPI's Linux build, which brings CUDA's libraries and runs on the CPU where there is no GPU
# (PyPI has no CPU-only build for Linux; docs/testing.md says why the test extra takes it).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tools="$(mktemp -d)"
trap 'rm -rf "$tools"' EXIT
python="$(bash "$root/scripts/find_python.sh")"
"$python" -m venv "$tools/venv"
"$tools/venv/bin/python" -m pip install -q --disable-pip-version-check "pip-tools>=7.4,<8"
cd "$root"
"$tools/venv/bin/pip-compile" -q --extra test --generate-hashes --strip-extras --unsafe-package glm-jax \
  --no-emit-index-url --no-emit-find-links --output-file requirements-lock.txt "$@" pyproject.toml
echo "wrote $root/requirements-lock.txt"
