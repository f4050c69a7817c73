#!/usr/bin/env bash
# Creates a Python 3.12 virtual environment with MaxText (pinned) for the
# compile-only experiments in this folder. It never touches the project's own
# .venv or requirements.txt.
#
# Usage: experiments/maxtext/setup_venv.sh
# Env:   MAXTEXT_VENV   where the venv goes (default: experiments/maxtext/.venv)
#        PYTHON312      the Python 3.12 interpreter (default: pyenv's 3.12.x)
#
# Safe to run again: once the install succeeded it writes a stamp file inside
# the venv and later runs do nothing.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${MAXTEXT_VENV:-${HERE}/.venv}"
MAXTEXT_SPEC="maxtext[tpu]==0.2.5"
STAMP="${VENV}/.maxtext_installed"

if [[ -f "${STAMP}" ]] && [[ "$(cat "${STAMP}")" == "${MAXTEXT_SPEC}" ]]; then
  echo "MaxText venv already set up at ${VENV} (${MAXTEXT_SPEC})."
  exit 0
fi

find_python312() {
  if [[ -n "${PYTHON312:-}" ]]; then echo "${PYTHON312}"; return; fi
  for p in /root/.pyenv/versions/3.12*/bin/python3.12 "$(command -v python3.12 || true)"; do
    if [[ -x "${p}" ]]; then echo "${p}"; return; fi
  done
  echo "No Python 3.12 found; set PYTHON312=/path/to/python3.12" >&2
  exit 1
}

PY="$(find_python312)"
echo "Using ${PY} ($("${PY}" --version)) to create ${VENV}"
if [[ ! -x "${VENV}/bin/python" ]]; then
  "${PY}" -m venv "${VENV}"
fi
"${VENV}/bin/python" -m pip install --upgrade pip
start=$(date +%s)
"${VENV}/bin/python" -m pip install "${MAXTEXT_SPEC}"
echo "pip install took $(( $(date +%s) - start )) s"
"${VENV}/bin/python" -c "import jax, maxtext; print('jax', jax.__version__)"
echo "${MAXTEXT_SPEC}" > "${STAMP}"
echo "MaxText venv ready at ${VENV}."
