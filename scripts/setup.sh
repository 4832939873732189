#!/usr/bin/env bash
# Creates ./.venv if missing and installs chemtrain with everything it needs,
# MPI included. Idempotent: a second run only checks a stamp and returns.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${CHEMTRAIN_VENV:-.venv}
STAMP="$VENV/.chemtrain-setup"
want=$(cat scripts/requirements.txt scripts/setup.sh pyproject.toml | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
export PATH="$PWD/$VENV/bin:$PATH"
echo "installing chemtrain and its dependencies into $VENV (a few minutes the first time)"
# -qq: errors only. pip's warnings here are about the machine's own pip
# configuration (index folders it lacks) and setuptools' notes on editable
# installs, nothing a user of chemtrain can act on.
Q=-qq
"$PY" -m pip install $Q --upgrade pip
"$PY" -m pip install $Q -r scripts/requirements.txt
# jax-md's declared requirements pull pymatgen, pandas and plotly (~220 MB)
# that only jax_md.a2c uses; its import-time needs are in requirements.txt.
"$PY" -m pip install $Q --no-deps jax-md==0.2.29
# mpi4jax compiles against the mpicc on PATH (the mpich wheel's). A CUDA
# toolkit without a GPU breaks its build, so hide it; never reuse a cached
# wheel built against another MPI.
if ! "$PY" -c "import mpi4jax" >/dev/null 2>&1; then
  CUDA_PATH=$(mktemp -d) "$PY" -m pip install $Q --no-cache-dir "mpi4jax==0.9.1.post2"
fi
# SevenNet's published checkpoints (SevenNet-0, chemtrain.models.nequip):
# sevenn is installed for its files and never imported; its e3nn >= 0.5
# would conflict with mace-torch's pinned e3nn 0.4.4, so no dependencies
# here (the sevennet extra installs them, without mace-torch).
"$PY" -m pip install $Q --no-deps sevenn==0.13.0
# sevenn's own calculator, for the tests that load a checkpoint chemtrain
# wrote: the imports it needs beyond chemtrain's environment (e3nn 0.6
# among them), unpacked into a side folder that only those tests'
# subprocesses put on PYTHONPATH.
SIDE="$VENV/sevenn-side"
if [ ! -d "$SIDE/e3nn" ]; then
  tmp=$(mktemp -d)
  "$PY" -m pip download $Q --no-deps -d "$tmp" e3nn==0.6.0 torch_geometric==2.8.1 \
    xxhash==4.1.0 braceexpand==0.1.7 scikit-learn==1.9.1 joblib==1.6.0 threadpoolctl==3.8.0 \
    cloudpickle==3.1.3 narwhals==2.29.0
  rm -rf "$SIDE.part"
  for f in "$tmp"/*.whl; do "$PY" -m zipfile -e "$f" "$SIDE.part"; done
  mv "$SIDE.part" "$SIDE"
  rm -rf "$tmp"
fi
"$PY" -m pip install $Q --no-deps -e .
echo "$want" > "$STAMP"
echo "chemtrain environment ready in $VENV"
