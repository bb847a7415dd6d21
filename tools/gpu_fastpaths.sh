#!/usr/bin/env bash
# Issue 16's checks on a lent GPU node (docs/gpu-checks.md): worker delivery with the engine on
# CUDA (Qwen3-0.6B shape, bf16), and the manager relay (a CPU path; the node's 16 cores give the
# manager a core of its own) A/B against the tree before the columnar change, when one is
# carried in .devbin/before. Same setup as tools/gpu_checks.sh: wheels in .whl/, etcd in .devbin/.
source tools/gpu_env.sh
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc
  python3 -c "import vllm; print('vllm', vllm.__version__)" 2>&1 | tail -n 1; } | tee "$OUT/node.txt"
timeout "${RLH_DELIVERY_TIMEOUT:-170}" python3 bench/worker_delivery.py --device cuda \
    --dtype bfloat16 --model qwen3-0.6b --batch 32 --tokens 128 --repeats 3 2>&1 \
    | tee "$OUT/worker_delivery.txt"
BEFORE=${RLH_BEFORE:-.devbin/before}
METRIC='per manager CPU-second \(one core\) \| ([\d,]+)'
if [ -d "$BEFORE" ]; then
  for capacity in 256 64; do
    timeout "${RLH_RELAY_TIMEOUT:-130}" python3 bench/ab_trees.py --a "$BEFORE" --b . \
        --script manager_relay.py --metric "$METRIC" --repeat 2 -- --quick --no-write \
        --capacity "$capacity" 2>&1 | tee "$OUT/relay_ab_$capacity.txt"
  done
fi
