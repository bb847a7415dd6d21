"""Serving with rollout harvested in its slack, real processes (ROSE Table 2 analogue).

One ``rlharvest-coexecutor`` process (serving model ``small``, the job's model ``small`` too,
as the paper pairs models of one size; one torch thread) behind a real manager and etcd, driven by two loads at once: serving traffic
replayed open-loop by ``rlharvest-loadgen``'s ``replay`` (a synthetic bursty trace) against its
OpenAI-compatible API, and rollout steps submitted to the manager back to back. Configurations,
each on a freshly started co-executor, interleaved over rounds (the order rotates):

- ``serving alone``: no rollout submitted — the serving baseline;
- ``dual``: ROSE's preemptive memory sharing + dual-SLO admission (the default);
- ``static``: Table 2's static partition (half the pool each, no compute admission);
- ``dedicated``: a plain rollout worker on the same core, rollout only — what a dedicated
  device yields, the denominator of the harvest.

The SLOs are the paper's calibration: 1.6x serving alone's P99 TTFT and TPOT, taken from a
serving-alone run at the start of the same invocation and given to every co-executor. Prints per configuration (medians over rounds):
serving P99 TTFT/TPOT, SLO attainment, and rollout tokens/s as a share of the dedicated
worker's. Needs a few minutes; ``--quick`` runs one short round.

    python bench/coexec_serving.py [--quick] [--rounds 3] [--seconds 20] [--rps 2] [--kv-memory pool|slots] [--chunk 512]

On a GPU, the paper's setting: Qwen3-8B-shaped random-init models in bfloat16 on one device and
the paper's SLOs (TTFT 500 ms, TPOT 150 ms) given instead of calibrated:

    python bench/coexec_serving.py --device cuda --dtype bfloat16 --serving-model qwen3-8b \
        --rollout-model qwen3-8b --ttft-slo-ms 500 --tpot-slo-ms 150
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlharvest.common.local_etcd import free_port  # noqa: E402
from rlharvest.cli import loadgen  # noqa: E402
from rlharvest.cli.launcher import LocalStack, ServiceProcess  # noqa: E402
from rlharvest.sim.serving_trace import synthetic  # noqa: E402
from tests.integration.test_manager import scrape  # noqa: E402

from bench.manager_preemption import manager_status, run_step, step_request  # noqa: E402

MODEL = "served"
CONFIGS = ("serving alone", "dual", "static", "dedicated")


def wait_http(url: str, proc: ServiceProcess, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if not proc.alive():
            raise RuntimeError(f"process exited:\n{proc.log_tail()}")
        try:
            urllib.request.urlopen(url, timeout=1)
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} not up:\n{proc.log_tail()}") from None
            time.sleep(0.2)


def start_rollout_side(stack: LocalStack, config: str, name: str, slo: tuple[float, float],
                       args: argparse.Namespace) -> tuple[ServiceProcess, int, str]:
    """The co-executor (or, for ``dedicated``, a rollout worker); its metrics port and URL."""
    port, metrics, http = free_port(), free_port(), free_port()
    common = ["--port", str(port), "--metrics-port", str(metrics), "--lease-ttl", "2",
              "--torch-threads", "1", "--max-running", "8", "--drain-timeout", "1",
              "--device", args.device, "--dtype", args.dtype, "--json-logs"]
    if config == "dedicated":
        proc = stack.start("rollout_worker", name, ["--worker-id", name, "--model",
                                                    args.rollout_model, *common])
    else:
        policy = ["--policy", "static_partition"] if config == "static" else []
        policy += ["--kv-memory", args.kv_memory, "--rollout-prefill-chunk", str(args.chunk)]
        proc = stack.start("coexecutor", name, [
            "--coexec-id", name, "--http-port", str(http), "--serving-model",
            args.serving_model, "--model", args.rollout_model,
            "--served-model-name", MODEL, "--total-pages", str(args.total_pages),
            "--page-tokens", "16",
            "--ttft-slo-ms", f"{1000 * slo[0]:.3f}", "--tpot-slo-ms", f"{1000 * slo[1]:.3f}",
            *policy, *common])
    wait_http(f"http://127.0.0.1:{metrics}/healthz", proc)
    return proc, metrics, f"http://127.0.0.1:{http}"


async def rollout_load(manager: str, until: float) -> None:
    """Steps of 16 x 48 tokens, back to back, until ``until`` (the rollout side counts what it
    generated)."""
    step = 0
    while time.perf_counter() < until:
        step += 1
        await run_step(manager, step_request(f"s{step}-", [48] * 16), None, lambda: None)


async def wait_worker(manager: str, name: str, timeout: float = 60) -> None:
    """Until ``name`` is the only healthy worker (the last run's has left)."""
    deadline = time.monotonic() + timeout
    while True:
        workers = (await manager_status(manager)).workers
        if [w.worker_id for w in workers if w.state == "healthy"] == [name]:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} did not become the manager's only worker: "
                               f"{[(w.worker_id, w.state) for w in workers]}")
        await asyncio.sleep(0.2)


async def one_run(stack: LocalStack, manager: str, config: str, name: str,
                  args: argparse.Namespace, slo: tuple[float, float]) -> dict:
    proc, metrics, url = start_rollout_side(stack, config, name, slo, args)
    try:
        await wait_worker(manager, name)
        start = time.perf_counter()
        until = start + args.seconds
        trace = [loadgen.fit_to_context(r, 256) for r in synthetic(
            args.seconds, args.rps, seed=args.seed, max_tokens=256, prompt_median=64,
            output_median=32)]
        serving = (loadgen.replay(url, MODEL, trace, max_seconds=args.seconds)
                   if config != "dedicated" else asyncio.sleep(0, result=[]))
        rollout = (rollout_load(manager, until) if config != "serving alone"
                   else asyncio.sleep(0))
        results, _ = await asyncio.gather(serving, rollout)
        elapsed = time.perf_counter() - start
        generated = scrape(metrics).get("rlh_worker_tokens_generated_total", 0.0)
        return {"results": results, "rollout_tps": generated / elapsed}
    finally:
        proc.terminate()


async def calibrate(stack: LocalStack, manager: str,
                    args: argparse.Namespace) -> tuple[float, float]:
    """The SLOs every co-executor then enforces: 1.6x serving alone's P99 (the paper's ratio).
    Twice as long as a measured run: a P99 over a few dozen requests is noisy."""
    run = await one_run(stack, manager, "serving alone", "calibrate",
                        argparse.Namespace(**{**vars(args), "seconds": 2 * args.seconds}),
                        (10.0, 10.0))
    ttft99, tpot99 = tails(run["results"])
    return 1.6 * ttft99, 1.6 * tpot99


def tails(results: list) -> tuple[float, float]:
    ok = [r for r in results if r.ok]
    return (loadgen.quantile([r.ttft_s for r in ok], 0.99),
            loadgen.quantile([r.tpot_s for r in ok if r.tokens >= 2], 0.99))


async def bench(args: argparse.Namespace) -> None:
    stack = LocalStack(Path(tempfile.mkdtemp(prefix="rlh-coexec-")))
    stack.start_etcd()
    manager_port, manager_metrics = free_port(), free_port()
    manager = stack.start("rollout_manager", "manager", [
        "--port", str(manager_port), "--metrics-port", str(manager_metrics), "--lease-ttl", "2",
        "--stall-timeout-s", "10", "--max-serving-workers", "1"])  # borrows each co-executor
    wait_http(f"http://127.0.0.1:{manager_metrics}/healthz", manager)
    endpoint = f"127.0.0.1:{manager_port}"
    runs: dict[str, list[dict]] = {c: [] for c in CONFIGS}
    try:
        slo = (args.ttft_slo_ms / 1000, args.tpot_slo_ms / 1000)
        if not all(slo):
            slo = await calibrate(stack, endpoint, args)
        for r in range(args.rounds):
            for i, config in enumerate(CONFIGS[r % 4:] + CONFIGS[:r % 4]):
                runs[config].append(await one_run(stack, endpoint, config, f"c{r}-{i}", args,
                                                  slo))
            print(f"  round {r} done", flush=True)
    finally:
        stack.stop()
    ttft_slo, tpot_slo = slo
    dedicated = statistics.median(run["rollout_tps"] for run in runs["dedicated"])
    source = "given" if args.ttft_slo_ms and args.tpot_slo_ms else "1.6x serving-alone P99"
    print(f"{args.seconds:.0f} s per run, {args.rounds} round(s), {args.rps} req/s, serving "
          f"{args.serving_model}, rollout {args.rollout_model}, {args.device} {args.dtype}; "
          f"SLOs ({source}): TTFT {1000 * ttft_slo:.0f} ms, TPOT {1000 * tpot_slo:.1f} ms; "
          f"dedicated worker: {dedicated:.0f} rollout tokens/s")
    print(f"{'config':16s} {'P99 TTFT':>10s} {'P99 TPOT':>10s} {'attained':>9s} "
          f"{'harvest':>18s}")
    for config in CONFIGS[:3]:
        rows = [(*tails(run["results"]),
                 loadgen.report(run["results"], ttft_slo, tpot_slo, args.seconds).attainment,
                 run["rollout_tps"] / dedicated) for run in runs[config]]
        med = [statistics.median(c) for c in zip(*rows)]
        harvest = [row[3] for row in rows]
        print(f"{config:16s} {1000 * med[0]:8.0f}ms {1000 * med[1]:8.1f}ms {med[2]:9.1%} "
              f"{med[3]:7.0%} [{min(harvest):.0%}-{max(harvest):.0%}]")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rps", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-memory", default="pool", choices=["pool", "slots"],
                        help="the co-executor's KV: one paged pool (default) or slot caches")
    parser.add_argument("--chunk", type=int, default=512,
                        help="the co-executor's rollout prefill chunk (tokens)")
    parser.add_argument("--rollout-model", default="small",
                        help="the job's model (a preset; the paper pairs models of one size)")
    parser.add_argument("--serving-model", default="small", help="the serving model (a preset)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (both sides)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--total-pages", type=int, default=256,
                        help="the co-executor's KV pool (16-token pages)")
    parser.add_argument("--ttft-slo-ms", type=float, default=0.0,
                        help="with --tpot-slo-ms: fixed SLOs instead of the calibration run")
    parser.add_argument("--tpot-slo-ms", type=float, default=0.0)
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.seconds = 1, 8.0
    asyncio.run(bench(args))


if __name__ == "__main__":
    main()
