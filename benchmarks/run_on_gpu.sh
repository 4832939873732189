#!/usr/bin/env bash
# The MACE benchmark on a GPU machine that has JAX (CUDA) and PyTorch but
# no network: the missing packages come as wheels in .whl/ (pure-Python ones
# and cp312 builds; see docs/performance.md for the list).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import jax, torch; print('jax', jax.__version__, jax.devices(), 'torch', torch.__version__)"
for model in small medium; do
    python3 benchmarks/mace_vs_torch.py --model "$model" --device cuda --repeats 20 2>&1 \
        | grep -v -i warn | tee -a "$OUT/gpu_bench.log" \
    || python3 benchmarks/mace_vs_torch.py --model "$model" --device cuda --repeats 20 --method naive 2>&1 \
        | grep -v -i warn | tee -a "$OUT/gpu_bench.log"
done
# DiffTRe on MACE (issue 20's probe): peak memory per vmap_batch, reweight against recompute
python3 benchmarks/difftre_mace.py --snapshots 200 --big 2000 2>&1 \
    | grep -v -i warn | tee -a "$OUT/gpu_bench.log"
# Committees (issue 34): K members in one vectorised step against K runs, the
# committee calculator against K calls, peak memory against K
python3 benchmarks/ensemble.py --members 4 --epochs 5 2>&1 \
    | grep -v -i warn | tee -a "$OUT/gpu_bench.log"
python3 benchmarks/ensemble.py --members 8 --epochs 5 --memory-k 1,8,16 2>&1 \
    | grep -v -i warn | tee -a "$OUT/gpu_bench.log"
