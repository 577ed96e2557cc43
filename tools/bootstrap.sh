#!/usr/bin/env bash
# Creates the project's virtual environment and installs the fork into it (editable), idempotently:
#   tools/bootstrap.sh            (make install calls it; make test / make demo depend on it)
# - reuses a torch that the base interpreter already has (a GPU user's build stays), else installs
#   TORCH_SPEC (default torch==2.13.0: the CPU build on our CI machines);
# - fetches the pinned upstream archive (hash-checked), assembles build/fork, pip install -e .
# Re-running only re-links our files unless requirements, setup.py or patches changed.
# MEGATRON_MUON_BASE=0.19.2 (make install BASE=0.19.2): the staged next base instead, in
# .venv-0.19.2 with Python 3.12 (python3.12, else pyenv's), requirements/0.19.2.txt (torch from the
# package index: the CUDA build), build/fork-0.19.2; then a smoke (tools/smoke_0192.py).
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=${MEGATRON_MUON_BASE:-0.16.1}
export MEGATRON_MUON_BASE=$BASE
if [ "$BASE" = 0.16.1 ]; then
  VENV=${VENV:-.venv}
  PYTHON=${PYTHON:-python3}
  REQS="requirements/base.txt requirements/build.txt requirements/dev.txt"
  SERIES=patches
else
  VENV=${VENV:-.venv-$BASE}
  if [ -z "${PYTHON:-}" ]; then
    PYTHON=python3.12
    "$PYTHON" -c "" 2>/dev/null || PYTHON=$(ls -d "$(pyenv root)"/versions/3.12*/bin/python3.12 | tail -1)
  fi
  REQS="requirements/$BASE.txt requirements/dev.txt"
  SERIES=patches/$BASE
fi
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
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
want=$(cat requirements/*.txt setup.py pyproject.toml "$SERIES"/*.patch | sha256sum)
stamp="$VENV/.bootstrap"
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  exec "$py" tools/fork.py assemble  # cheap: refresh the links to our files
fi

"$py" -c "import torch" 2>/dev/null || "$py" -m pip install -q "$TORCH_SPEC"
# shellcheck disable=SC2086
"$py" -m pip install -q $(printf -- '-r %s ' $REQS)
"$py" tools/fork.py fetch
"$py" -m pip install -q --no-build-isolation --no-deps -e . --config-settings editable_mode=compat
echo "$want" > "$stamp"
"$py" -W ignore -c "import megatron.core.package_info, torch; print('bootstrap: megatron-core', \
megatron.core.package_info.__version__, 'from', megatron.core.__path__[0], '| torch', torch.__version__)"
if [ "$BASE" != 0.16.1 ]; then
  "$py" -W ignore tools/smoke_0192.py
fi
