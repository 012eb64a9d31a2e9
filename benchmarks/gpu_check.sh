#!/usr/bin/env bash
# The GPU check: run it whenever a CUDA machine is lent, from the repo root, and put its
# figures in README ("GPU figures").
#
#     bash benchmarks/gpu_check.sh            # a few minutes on one GPU
#
# It installs nothing beyond `make install`, and only when no Python with a CUDA torch
# and mmcache's dependencies is found (an existing .venv, or $PYTHON). Steps, each
# printing its figures (a failing step is reported and the others still run):
#   1. the CUDA tests (those that skip without CUDA: augment on cuda, the GPU tiers)
#   2. benchmarks/augment.py --device cuda   (random crops after the cache, on the GPU)
#   3. benchmarks/features.py --gpu          (FeatureCache GPU tier, ViT-L/14 fp16)
#   4. benchmarks/cluster.py --quick with MMCACHE_EXCHANGE_BACKEND=nccl (the cluster
#      exchange over NCCL, payloads in pinned memory), only with 2+ GPUs: NCCL refuses
#      two ranks on one device, so one lent GPU cannot check it
# Set QUICK=1 for smaller runs (a machine with little time left).
set -u
cd "$(dirname "$0")/.."

pick_python() {
    for py in "${PYTHON:-}" .venv/bin/python python3 python; do
        [ -n "$py" ] || continue
        command -v "$py" >/dev/null 2>&1 || [ -x "$py" ] || continue
        if "$py" -c 'import torch, numpy, PIL, lmdb, xxhash, tokenizers, pytest; assert torch.cuda.is_available()' \
            >/dev/null 2>&1; then
            echo "$py"
            return 0
        fi
    done
    return 1
}

PY="$(pick_python)" || {
    echo "== no Python with a CUDA torch and mmcache's dependencies: make install"
    make install || { echo "make install failed"; exit 2; }
    PY="$(pick_python)" || { echo "no CUDA torch after make install (is this a GPU machine?)"; exit 2; }
}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false

"$PY" - <<'EOF'
import torch, mmcache
print(f"== torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"{torch.cuda.get_device_name(0)}, mmcache from {mmcache.__file__}")
EOF

status=0
step() {
    local name="$1"; shift
    echo
    echo "== $name: $*"
    local t0=$SECONDS
    "$@"
    local rc=$?
    echo "== $name: exit $rc in $((SECONDS - t0)) s"
    [ "$rc" -eq 0 ] || status=1
}

# 1. The tests with a CUDA path (each skips without CUDA; here none may skip).
step "CUDA tests" "$PY" -m pytest -q -p no:cacheprovider -rs \
    tests/unit/test_augment.py tests/unit/test_features.py tests/unit/test_pipeline.py \
    -k "cuda or gpu or device"

if [ "${QUICK:-0}" = 1 ]; then
    step "augment on cuda" "$PY" benchmarks/augment.py --device cuda --quick \
        --out benchmarks/results/augment-cuda.md
    step "FeatureCache GPU tier" "$PY" benchmarks/features.py --gpu --samples 512 \
        --skip-fingerprint
else
    step "augment on cuda" "$PY" benchmarks/augment.py --device cuda --n 2048 \
        --out benchmarks/results/augment-cuda.md
    step "FeatureCache GPU tier" "$PY" benchmarks/features.py --gpu
fi

gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
if [ "$gpus" -ge 2 ]; then
    step "cluster exchange over NCCL" env MMCACHE_EXCHANGE_BACKEND=nccl \
        "$PY" benchmarks/cluster.py --quick --out benchmarks/results/cluster-nccl.json
else
    echo
    echo "== cluster exchange over NCCL: skipped ($gpus GPU; NCCL needs one device per rank)"
fi

echo
echo "== gpu_check done: $([ "$status" -eq 0 ] && echo 'all steps passed' || echo 'a step FAILED')"
exit "$status"
