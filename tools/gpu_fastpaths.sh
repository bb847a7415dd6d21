#!/usr/bin/env bash
# The fast paths' and prefix cache's checks on a lent GPU node (docs/gpu-checks.md): deltas encoded and applied
# on CUDA (the CUDA-only tests, tools/gpu_delta_profile.py, then bench/transfer_delta.py with the
# trainer on cuda and the worker's copy on cuda, then on cpu: RLH_DELTA_WORKERS), the
# torch engine's step costs at Qwen3 shapes (tools/step_costs.py: the agentic simulator's cost
# model, measured), the manager relay (a CPU path; the node's 16 cores give the manager a core of
# its own), A/B against the tree before the columnar change when one is carried in
# .devbin/before, and worker delivery with the engine on CUDA (RLH_DELIVERY=1).
# Same setup as tools/gpu_checks.sh: wheels in .whl/, etcd in .devbin/.
source tools/gpu_env.sh
export PYTHONPATH="$PYTHONPATH:$PWD"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc
  python3 -c "import vllm; print('vllm', vllm.__version__)" 2>&1 | tail -n 1; } | tee "$OUT/node.txt"
if [ -z "${RLH_SKIP_DELTA:-}" ]; then
  timeout 480 python3 -m pytest -q -p no:cacheprovider -rs tests/unit/test_transfer_sums.py \
      tests/integration/test_transfer_agent.py tests/integration/test_trainer.py -k "cuda or gpu or sums" 2>&1 | tail -n 30 \
      | tee "$OUT/delta_tests.txt"
  if [ -z "${RLH_SKIP_DELTA_BENCH:-}" ]; then  # the tests above only, when set
    timeout 120 python3 tools/gpu_delta_profile.py 2>&1 | tee "$OUT/delta_profile.txt"
    for worker in ${RLH_DELTA_WORKERS:-cuda cpu}; do  # where the worker holds its copy
      timeout "${RLH_DELTA_TIMEOUT:-180}" python3 bench/transfer_delta.py --device cuda \
          --worker-device "$worker" 2>&1 | tee "$OUT/transfer_delta_cuda_$worker.txt"
    done
  fi
fi
if [ -z "${RLH_SKIP_STEP_COSTS:-}" ]; then
  for preset in qwen3-8b qwen3-0.6b; do
    timeout 150 python3 tools/step_costs.py --preset "$preset" --device cuda --dtype bfloat16 \
        --prefills 256 512 1024 2048 4096 2>&1 | tee "$OUT/step_costs_$preset.txt"
  done
fi
BEFORE=${RLH_BEFORE:-.devbin/before}
METRIC='per manager CPU-second \(one core\) \| ([\d,]+)'
for capacity in ${RLH_RELAY_CAPACITIES-256}; do
  if [ -d "$BEFORE" ]; then
    timeout "${RLH_RELAY_TIMEOUT:-130}" python3 bench/ab_trees.py --a "$BEFORE" --b . \
        --script manager_relay.py --metric "$METRIC" --repeat 2 -- --quick --no-write \
        --capacity "$capacity" 2>&1 | tee "$OUT/relay_ab_$capacity.txt"
  else
    timeout "${RLH_RELAY_TIMEOUT:-130}" python3 bench/manager_relay.py --quick --no-write \
        --capacity "$capacity" 2>&1 | tee "$OUT/relay_$capacity.txt"
  fi
done
if [ -n "${RLH_DELIVERY:-}" ]; then
  timeout "${RLH_DELIVERY_TIMEOUT:-170}" python3 bench/worker_delivery.py --device cuda \
      --dtype bfloat16 --model qwen3-0.6b --batch 32 --tokens 128 --repeats 3 2>&1 \
      | tee "$OUT/worker_delivery.txt"
fi
