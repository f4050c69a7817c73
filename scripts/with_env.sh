#!/usr/bin/env bash
# Runs a command inside the project's virtual environment, creating or refreshing it first.
#   bash scripts/with_env.sh python launch/train.py --config=configs/glm5_tiny.py
#   bash scripts/with_env.sh pytest -n 2 --dist loadfile tests
# The venv lives in .venv (override with GLM_JAX_VENV) and holds exactly requirements-lock.txt (the package's
# dependencies and its test extra, hashes checked; scripts/lock.sh refreshes it) and glm-jax itself, editable. It is
# rebuilt only when pyproject.toml, the lock or the Python change. Python 3.12: $PYTHON, else the one
# scripts/find_python.sh finds on PATH or in pyenv.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${GLM_JAX_VENV:-$root/.venv}"
stamp="$venv/.glm-jax-installed"
python="$(bash "$root/scripts/find_python.sh")"
want="$({ cat "$root/pyproject.toml" "$root/requirements-lock.txt"; echo "$python"; } | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  # A venv this script made (it has the stamp) is rebuilt from scratch, so nothing outside the lock lingers in it;
  # any other non-empty directory there is not ours to delete.
  if [ ! -f "$stamp" ] && [ -n "$(ls -A "$venv" 2>/dev/null)" ]; then
    echo "error: $venv is not empty and was not made by scripts/with_env.sh (no $stamp); move it, or set" \
      "GLM_JAX_VENV to another path" >&2
    exit 2
  fi
  echo "[with_env] setting up $venv (first run, or pyproject.toml or the lock changed; a few minutes)" >&2
  rm -rf "$venv"
  "$python" -m venv "$venv"
  log="$venv/pip-install.log"
  pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
  { "${pip[@]}" --require-hashes --no-deps -r "$root/requirements-lock.txt" \
      && "${pip[@]}" --no-deps -e "$root"; } > "$log" 2>&1 || { cat "$log" >&2; exit 1; }
  echo "$want" > "$stamp"
fi
cd "$root"
export PATH="$venv/bin:$PATH"
# The venv has libtpu (for compiling to TPU topologies); on a host without TPU chips keep jax on the CPU rather
# than have every process probe for a TPU and contend for libtpu's lockfile. Set JAX_PLATFORMS to override.
if [ -z "${JAX_PLATFORMS+x}" ] && ! ls /dev/accel0 /dev/vfio/0 >/dev/null 2>&1; then
  export JAX_PLATFORMS=cpu
fi
exec "$@"
