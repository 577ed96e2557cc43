#!/usr/bin/env bash
# Creates the project's virtual environment and installs the fork into it (editable), idempotently:
#   tools/bootstrap.sh            (make install calls it; make test / make demo depend on it)
# - reuses a torch that the base interpreter already has (a GPU user's build stays), else installs
#   TORCH_SPEC (default torch==2.13.0: the CPU build on our CI machines);
# - fetches the pinned upstream archive (hash-checked), assembles build/fork, pip install -e .
# Re-running only re-links our files unless requirements, setup.py or patches changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
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
want=$(cat requirements/*.txt setup.py pyproject.toml patches/*.patch | sha256sum)
stamp="$VENV/.bootstrap"
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  exec "$py" tools/fork.py assemble  # cheap: refresh the links to our files
fi

"$py" -c "import torch" 2>/dev/null || "$py" -m pip install -q "$TORCH_SPEC"
"$py" -m pip install -q -r requirements/base.txt -r requirements/build.txt -r requirements/dev.txt
"$py" tools/fork.py fetch
"$py" -m pip install -q --no-build-isolation --no-deps -e . --config-settings editable_mode=compat
echo "$want" > "$stamp"
"$py" -W ignore -c "import megatron.core.package_info, torch; print('bootstrap: megatron-core', \
megatron.core.package_info.__version__, 'from', megatron.core.__path__[0], '| torch', torch.__version__)"
