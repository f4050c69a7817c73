#!/usr/bin/env bash
# Runs a command inside the project's virtual environment, creating or refreshing it first.
#   bash scripts/with_env.sh python launch/model_info.py --config=configs/glm5_tiny.py
#   bash scripts/with_env.sh pytest -n 2 --dist loadfile tests
# The venv lives in .venv (override with GLM_JAX_VENV); it is rebuilt only when requirements*.txt or
# setup.cfg change. Python: $PYTHON, else python3 (3.11 and 3.12 are supported).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${GLM_JAX_VENV:-$root/.venv}"
stamp="$venv/.glm-jax-installed"
want="$(cat "$root"/requirements*.txt "$root/setup.cfg" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[with_env] setting up $venv (first run or requirements changed; a few minutes)" >&2
  "${PYTHON:-python3}" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$root/requirements-test.txt" \
    > "$venv/pip-install.log" 2>&1 || { cat "$venv/pip-install.log" >&2; exit 1; }
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e "$root" \
    >> "$venv/pip-install.log" 2>&1 || { cat "$venv/pip-install.log" >&2; exit 1; }
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
