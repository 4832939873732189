#!/usr/bin/env bash
# Every benchmark in benchmarks/ on a GPU machine that has JAX (CUDA) and
# PyTorch but no network: the missing packages come as wheels in .whl/
# (pure-Python ones and cp312 builds; see docs/performance.md for the list).
# Each benchmark runs on its own: one that fails (e.g. no mpirun on the
# machine) is reported and the next one runs. Output: $OUT/gpu_bench.log.
#   bash benchmarks/run_on_gpu.sh            # all, the quick settings below
#   bash benchmarks/run_on_gpu.sh mace difftre_mace   # only those named
set -uo pipefail
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
LOG="$OUT/gpu_bench.log"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | tee -a "$LOG"
python3 -c "import jax, torch; print('jax', jax.__version__, jax.devices(), 'torch', torch.__version__)" \
    2>&1 | tee -a "$LOG"

SELECTED="$*"
bench() {   # bench NAME COMMAND...: run, log, report failure, go on
    local name=$1; shift
    if [ -n "$SELECTED" ] && [[ " $SELECTED " != *" $name "* ]]; then return 0; fi
    echo "=== $name: $*" | tee -a "$LOG"
    local t0=$SECONDS
    "$@" 2>&1 | grep -v -i warn | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$LOG"
    return "$rc"
}

# MACE against mace-torch, MACE-MP-0 sizes (the CUDA kernel, else naive)
for model in small medium; do
    bench mace python3 benchmarks/mace_vs_torch.py --model "$model" --device cuda --repeats 20 \
    || bench mace python3 benchmarks/mace_vs_torch.py --model "$model" --device cuda --repeats 20 \
        --method naive
done
# the main job's training against mace_run_train (accuracy and epoch ratio)
bench accuracy python3 benchmarks/accuracy_vs_mace_torch.py --work "$OUT/accuracy"
# where the main job's step spends its time
bench profile python3 benchmarks/profile_main_job.py --steps 10
# fine-tuning without forgetting against mace-torch (short)
bench finetune python3 benchmarks/finetune_vs_mace_torch.py --epochs 2 --foundation-epochs 2
# DiffTRe on MACE: peak memory per vmap_batch, reweight against recompute
bench difftre_mace python3 benchmarks/difftre_mace.py --snapshots 200 --big 2000
# DiffTRe on Lennard-Jones: trajectory generator against a bare jax-md scan
bench difftre python3 benchmarks/difftre.py --repeats 3
# committees: K members in one vectorised step against K runs
bench ensemble python3 benchmarks/ensemble.py --members 4 --epochs 5
bench ensemble python3 benchmarks/ensemble.py --members 8 --epochs 5 --memory-k 1,8,16
# graphs against neighbor lists, trainer overhead, HDF5 loader
bench graphs python3 benchmarks/graphs.py
bench overhead python3 benchmarks/overhead.py
bench hdf5 python3 benchmarks/hdf5_loader.py
# parallel methods and DiffTRe over MPI (need mpirun and mpi4jax on the machine)
bench parallel python3 benchmarks/parallel.py
bench difftre_parallel python3 benchmarks/difftre_parallel.py --epochs 3
# reweighting on problems with known answers (short)
bench known_answers python3 benchmarks/reweighting_known_answers.py --problem re-bond \
    --updates 200 --seeds 0
# learning from dynamics: argon's cost with and without a neighbor list
bench argon_costs python3 benchmarks/argon_costs.py --modes cell,all --batches 1,10
# NequIP's message tensor product: ours against cuequivariance's kernel
# (needs the sevenn package for SevenNet-0's file)
bench nequip_tp python3 benchmarks/nequip_tensor_products.py --repeats 7
