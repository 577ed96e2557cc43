#!/usr/bin/env bash
# Creates the project's virtual environment and installs the fork into it (editable), idempotently:
#   tools/bootstrap.sh            (make install calls it; make test / make demo depend on it)
# - Python 3.12 (megatron-core 0.19.2 requires it): python3.12, else pyenv's, else PYTHON=...;
# - reuses a torch that the base interpreter already has (a GPU user's build stays), else installs
#   requirements/base.txt's (the package index's build);
# - fetches the pinned upstream archive (hash-checked), assembles build/fork, pip install -e .,
#   then a smoke run (tools/smoke.py).
# Re-running only re-links our files unless requirements, setup.py or patches changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
if [ -z "${PYTHON:-}" ]; then
  PYTHON=python3.12
  if ! "$PYTHON" -c "" 2>/dev/null; then
    PYTHON=$(ls -d "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12 2>/dev/null | tail -1)
    [ -n "$PYTHON" ] || { echo "bootstrap: needs Python 3.12 (set PYTHON=...)" >&2; exit 1; }
  fi
fi
py="$VENV/bin/python"

if [ ! -x "$py" ]; then
  if "$PYTHON" -c "import torch" 2>/dev/null; then
    echo "bootstrap: reusing the torch of $PYTHON"
    "$PYTHON" -m venv --system-site-packages "$VENV"
  else
    "$PYTHON" -m venv "$VENV"
  fi
fi

shopt -s nullglob
want=$(cat requirements/*.txt setup.py pyproject.toml patches/*.patch | sha256sum)
stamp="$VENV/.bootstrap"
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  exec "$py" tools/fork.py assemble  # cheap: refresh the links to our files
fi

keep='^$^'  # a torch already in the venv (the interpreter's, e.g. a GPU build) stays
"$py" -c "import torch" 2>/dev/null && keep='^torch=='
"$py" -m pip install -q -r <(grep -v "$keep" requirements/base.txt) -r requirements/dev.txt
"$py" tools/fork.py fetch
"$py" -m pip install -q --no-build-isolation --no-deps -e . --config-settings editable_mode=compat
echo "$want" > "$stamp"
"$py" -W ignore -c "import megatron.core.package_info, torch; print('bootstrap: megatron-core', \
megatron.core.package_info.__version__, 'from', megatron.core.__path__[0], '| torch', torch.__version__)"
"$py" -W ignore tools/smoke.py
