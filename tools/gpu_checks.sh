#!/usr/bin/env bash
# The GPU checks (ROSE's Table 2 analogue at Qwen3-8B shape; the torch engine on CUDA), run
# on a lent GPU machine by the device tool from the repository root, with the Python packages
# its image lacks as wheels in .whl/ and an etcd binary in .devbin/ (docs/gpu-checks.md says how
# to fetch both). Output goes to $OUT (the device tool brings it back) and stdout.
source tools/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
[ "${RLH_SKIP_SMOKE:-0}" = 1 ] || timeout 120 python3 tools/gpu_smoke.py 2>&1 | tee "$OUT/smoke.txt" || exit 1
if [ "${RLH_SKIP_COEXEC:-0}" != 1 ]; then
  timeout "${RLH_COEXEC_TIMEOUT:-330}" python3 bench/coexec_serving.py --device cuda \
      --dtype bfloat16 --serving-model qwen3-8b --rollout-model qwen3-8b --ttft-slo-ms 500 \
      --tpot-slo-ms 150 --rounds 1 --seconds 30 --rps "${RLH_COEXEC_RPS:-1}" --total-pages 1024 2>&1 \
      | tee "$OUT/coexec_8b.txt"
  ls /tmp/rlh-coexec-*/ >/dev/null 2>&1 && tail -n 30 /tmp/rlh-coexec-*/*.log > "$OUT/coexec_logs.txt" 2>&1
fi
[ "${RLH_SKIP_ENGINE:-0}" = 1 ] || timeout "${RLH_ENGINE_TIMEOUT:-150}" python3 bench/engine_throughput.py --device cuda \
    --dtype bfloat16 --presets qwen3-0.6b --checkpoints --batches 16 64 256 --new-tokens 64 \
    --rounds 3 --threads 0 2>&1 | tee "$OUT/engine_throughput.txt"
