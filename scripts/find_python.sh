#!/usr/bin/env bash
# Prints the path of a Python 3.12 interpreter, the version the project's venv and lock are made for (jax 0.12 needs
# 3.12 or newer). Looks at $PYTHON, then python3.12 and python3 on PATH, then pyenv's installed 3.12 releases; a
# pyenv shim whose version is not selected does not count. Run by with_env.sh and lock.sh; also runnable alone.
set -euo pipefail
want="3.12"
# A candidate that is Python $want prints its base interpreter, symlinks resolved: a venv's python (an activated
# venv's, with_env.sh's own included) names the interpreter that venv was made from, so the path is one stable answer.
base_if_want() {
  "$1" -c 'import os, sys; v = "%d.%d" % sys.version_info[:2]
if v == sys.argv[1]: print(os.path.realpath(sys._base_executable))' "$want" 2>/dev/null
}
found() { local py; py="$(base_if_want "$1")" && [ -n "$py" ] && echo "$py"; }
if [ -n "${PYTHON:-}" ]; then
  if found "$PYTHON"; then exit 0; fi
  echo "error: PYTHON=$PYTHON is not a Python $want interpreter (jax 0.12 and this project's lock need $want);" \
    "set PYTHON to one, or unset it to search PATH and pyenv" >&2
  exit 2
fi
for cand in python3.12 python3; do
  if command -v "$cand" >/dev/null && found "$cand"; then exit 0; fi
done
if command -v pyenv >/dev/null; then
  for version in $(pyenv versions --bare 2>/dev/null | grep -E "^${want/./\\.}\.[0-9]+$" | sort -V -r); do
    if found "$(pyenv root)/versions/$version/bin/python$want"; then exit 0; fi
  done
fi
echo "error: no Python $want found (looked at python3.12 and python3 on PATH, and pyenv's versions); install it" \
  "(e.g. \`pyenv install $want\`, or your system's python$want package) or set PYTHON=/path/to/python$want" >&2
exit 2
