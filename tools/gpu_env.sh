# Sourced by the GPU-node scripts (tools/gpu_checks.sh, tools/gpu_fastpaths.sh), run from the
# repository root: $OUT made (the device tool brings it back), the wheels the node's image lacks
# installed from .whl/ into /tmp/site, and etcd from .devbin/ on PATH (docs/gpu-checks.md).
set -uo pipefail
OUT=${OUT:-/tmp/rlh-gpu-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PATH="$PWD/.devbin:$PATH" PYTHONUNBUFFERED=1
