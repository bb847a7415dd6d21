"""One rollout manager in front of 64, 256 and 1,024 synthetic workers: what it costs, what it adds.

Real parts: a real etcd (LocalEtcd), one real manager process (`rlharvest-rollout-manager`, its
default balancer: Algorithm 2), processes of 64 synthetic workers each
(bench/manager_scale_workers.py: the real Session contract over gRPC, one server and one etcd
registration per worker, steps of ``a + b * batch`` seconds, log-normal request lengths), and a
client that submits steps like the trainer (``client.stream_step``). Per worker count N:

* manager CPU seconds per relayed token (its own CPU time, /proc/<pid>/stat);
* delivery latency (emission stamp carried in each delta, as manager_relay.py) through the
  manager vs a client reading one worker's Session directly, at the same time, on the same load;
* tick duration p50 / p99 (the manager's ``rlh_manager_tick_seconds`` histogram);
* manager RSS per request in flight; etcd requests per second (etcd's own /metrics);
* kill recovery: SIGKILL one whole worker process mid-step; the wall time until every request it
  ran has delivered tokens from another worker (target: within 2 s).

    python bench/manager_scale.py [--quick] [--sizes 64,256,1024] [--requests-per-worker 16]
           [--profile]   # also profile the manager (cProfile) at the largest N
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pstats
import signal
import subprocess
import sys
import json
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.manager_relay import (  # noqa: E402
    TIME_BASE,
    cpu_seconds,
    direct_latency,
    start_manager,
)
from bench.manager_scale_workers import LongTail  # noqa: E402
from rlharvest.cli.launcher import LocalStack  # noqa: E402
from rlharvest.common import delta_batch  # noqa: E402
from rlharvest.common.local_etcd import LocalEtcd, free_port, stop_processes  # noqa: E402
from rlharvest.common.observability import scrape  # noqa: E402
from rlharvest.common.pb import common_pb2, rollout_manager_pb2 as mpb  # noqa: E402
from rlharvest.services.rollout_manager.client import (  # noqa: E402
    manager_status,
    stream_step,
    wait_workers,
)  # noqa: E402

HOST = Path(__file__).resolve().parent / "manager_scale_workers.py"
RESULTS = Path(__file__).resolve().parent / "results" / "manager_scale.md"
MAX_MESSAGE = 256 * 1024 * 1024


# ---- the processes ---------------------------------------------------------------------------


@dataclass
class Fleet:
    stack: LocalStack
    hosts: list[subprocess.Popen]
    manager: subprocess.Popen
    endpoint: str
    metrics: str  # the manager's metrics host:port
    direct: str  # the unregistered worker of the direct-read baseline
    procs: list[subprocess.Popen] = field(default_factory=list)
    host_index: list[int] = field(default_factory=list)  # of each of hosts: its tokens' id - 1


def dilation(n: int, args: argparse.Namespace) -> float:
    """How much slower than the step-time model the workers run: this box (2 shared cores
    running the workers, the manager, etcd and the client) sustains about
    ``--box-tokens-per-s``, far below N GPUs' rate; the manager's CPU per token does not depend
    on the pace, and its demand at the real pace is that cost times the real rate."""
    return max(1.0, real_rate(n, args) / args.box_tokens_per_s)


def real_rate(n: int, args: argparse.Namespace) -> float:
    """Tokens per second N workers emit at the model's pace, every worker's batch full."""
    batch = args.requests_per_worker
    return n * batch / (args.step_a_s + args.step_b_s * batch)


def etcd_of(stack: LocalStack) -> LocalEtcd:
    assert stack.etcd is not None, "start the stack's etcd first"
    return stack.etcd


def start_host(stack: LocalStack, index: int, workers: int, args: argparse.Namespace,
               slower: float, direct_port: int = 0) -> subprocess.Popen:
    log = open(stack.log_dir / f"host{index}.log", "ab")
    return subprocess.Popen(
        [sys.executable, str(HOST), "--etcd", etcd_of(stack).endpoint, "--host-index", str(index),
         "--workers", str(workers), "--capacity", str(args.capacity),
         "--step-a-s", str(args.step_a_s * slower), "--step-b-s", str(args.step_b_s * slower),
         "--resumes-out", str(stack.log_dir / f"resumes{index}.json"),
         "--median-tokens", str(args.median_tokens), "--sigma", str(args.sigma),
         "--time-base", repr(TIME_BASE), "--direct-port", str(direct_port),
         "--lease-ttl", str(args.lease_ttl)],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def start_fleet(n: int, args: argparse.Namespace, profile: bool) -> Fleet:
    """etcd, the manager, then the worker processes one at a time, each once the manager has
    every worker of the one before: a manager joining hundreds of workers at once on this loaded
    box times some first connects out (no SETTINGS frame in time), and a worker whose session
    broke stays lost until it registers again."""
    stack = LocalStack(Path(tempfile.mkdtemp(prefix="rlh-scale-")))
    stack.start_etcd()
    metrics_port, direct_port = free_port(), free_port()
    profile_to = stack.log_dir / "manager.prof" if profile else None
    manager, endpoint = start_manager(stack, profile_to, (
        "--metrics-port", str(metrics_port), "--balancer", args.balancer,
        "--greeting-timeout-s", "0"))
    fleet = Fleet(stack, [], manager, endpoint, f"127.0.0.1:{metrics_port}",
                  f"127.0.0.1:{direct_port}", [manager])
    per_host = min(64, n // 4)  # at N=64: four processes of 16, so one can die
    try:
        asyncio.run(wait_workers(endpoint, 0, timeout=60))  # its status answers
        for i in range(n // per_host):
            start_workers(fleet, i, per_host, args, dilation(n, args),
                          direct_port if i == n // per_host - 1 else 0)
    except BaseException:
        status = asyncio.run(manager_status(endpoint))
        print("not healthy:", [(w.worker_id, w.state) for w in status.workers
                               if w.state != "healthy"] if status else "no status",
              file=sys.stderr)
        stop_fleet(fleet)
        raise
    return fleet


def start_workers(fleet: Fleet, index: int, per_host: int, args: argparse.Namespace,
                  slower: float, direct_port: int, tries: int = 3) -> None:
    """One worker process, started again under new worker ids (SIGKILL first) while the
    manager lost some of its workers at their first connect: a lost worker stays lost until it
    registers anew."""
    for attempt in range(tries):
        host_index = index + 64 * attempt  # also its tokens' id: below the tiny vocabulary
        host = start_host(fleet.stack, host_index, per_host, args, slower, direct_port)
        fleet.procs.append(host)
        try:
            asyncio.run(wait_workers(fleet.endpoint, names=[f"h{host_index}w{i}"
                                                            for i in range(per_host)], timeout=60))
            fleet.hosts.append(host)
            fleet.host_index.append(host_index)
            return
        except TimeoutError:
            if attempt == tries - 1:
                raise
            print(f"worker process {index}: some sessions never started; starting it again",
                  file=sys.stderr, flush=True)
            host.kill()
            host.wait()


def stop_fleet(fleet: Fleet) -> Path | None:
    """Stops everything; returns the manager's profile if it wrote one (SIGTERM: a clean exit)."""
    stop_processes(fleet.procs, timeout=60)
    fleet.stack.stop()
    prof = fleet.stack.log_dir / "manager.prof"
    return prof if prof.exists() else None


# ---- what the client sees --------------------------------------------------------------------


class StepWatch:
    """Reads one step's events: delivery latency per delta, tokens, completions, and per request
    which worker process (token id - 1) delivered its latest tokens, so a kill's victims and
    their recovery elsewhere are seen from the client, where they count."""

    def __init__(self, request: mpb.SubmitStepRequest, lengths: np.ndarray | None = None):
        count = len(request.requests)
        # Where each request ends (the workers draw it from its id): one whose last tokens came
        # before a kill is no victim, even while its completion is still on the way.
        self.lengths = np.full(count, np.iinfo(np.int64).max) if lengths is None else lengths
        self.index = {r.request_id: i for i, r in enumerate(request.requests)}
        self.latencies: list[np.ndarray] = []
        self.last_host = np.full(count, -1, np.int64)
        self.next_position = np.zeros(count, np.int64)
        self.done = np.zeros(count, bool)
        self.ended = np.zeros(count, bool)  # its last row came (its completion may not yet)
        self.tokens = self.failed = self.regenerated = 0
        self.killed_host, self.killed_at = -1, 0.0
        self.victims = np.zeros(count, bool)
        self.recovered_at = np.full(count, np.inf)

    def take(self, event: mpb.StepEvent) -> None:
        now = time.time()
        for c in event.completions:
            self.done[self.index[c.request_id]] = True
            self.failed += c.failed
            self.tokens += len(c.token_ids)
        rows = delta_batch.decode(event.batch)
        last = [row for row, why in rows.ends.items() if why != "abort"]  # abort: it moves
        if last:
            self.ended[rows.requests[last]] = True
        grew = rows.counts > 0
        if not grew.any():
            return
        starts = rows.starts()[grew]
        self.latencies.append(now - (TIME_BASE + rows.logprobs[starts].astype(float)))
        req, pos = rows.requests[grew], rows.positions[grew].astype(np.int64)
        host = rows.token_ids[starts].astype(np.int64) - 1
        self.regenerated += int(np.maximum(0, self.next_position[req] - pos).sum())
        self.next_position[req] = pos + rows.counts[grew]
        self.last_host[req] = host
        if self.killed_host >= 0:
            back = req[self.victims[req] & (host != self.killed_host)]
            self.recovered_at[back] = np.minimum(self.recovered_at[back], now)

    def started(self) -> float:
        return float((self.last_host >= 0).mean())

    def kill(self, host: subprocess.Popen, index: int) -> None:
        host.send_signal(signal.SIGKILL)
        self.killed_at = time.time()
        self.killed_host = index
        self.victims = (self.last_host == index) & ~self.ended & \
            (self.next_position < self.lengths)

    def recovery_s(self) -> tuple[float, int, int]:
        """Kill to the last victim's first tokens from elsewhere; victims, those never back."""
        back = self.recovered_at[self.victims]
        missing = int(np.isinf(back).sum())
        worst = float(back[~np.isinf(back)].max() - self.killed_at) if missing < len(back) \
            else float("nan")
        return worst, int(self.victims.sum()), missing

    def all_latencies(self) -> np.ndarray:
        return np.concatenate(self.latencies) if self.latencies else np.zeros(0)


def step_request(prefix: str, requests: int, max_tokens: int) -> mpb.SubmitStepRequest:
    return mpb.SubmitStepRequest(step_id=prefix, weight_version=0, requests=[
        mpb.RolloutRequest(request_id=f"{prefix}{i}", group_id=f"g{i // 8}",
                           prompt_token_ids=[1, 2, 3],
                           sampling=common_pb2.SamplingParams(max_tokens=max_tokens))
        for i in range(requests)])


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


async def run_step(fleet: Fleet, request: mpb.SubmitStepRequest, kill: int = -1,
                   kill_after_s: float = 1.0, lengths: np.ndarray | None = None
                   ) -> tuple[StepWatch, int]:
    """Streams the step to its end; with ``kill`` >= 0, SIGKILLs that worker process once nearly
    every request has started and ``kill_after_s`` passed. Returns the watch and the manager's
    peak RSS seen meanwhile."""
    watch, peak = StepWatch(request, lengths), rss_bytes(fleet.manager.pid)
    begun, last_sample = time.monotonic(), 0.0
    async for event in stream_step(fleet.endpoint, request, MAX_MESSAGE):
        watch.take(event)
        now = time.monotonic()
        if now - last_sample > 0.2:
            peak, last_sample = max(peak, rss_bytes(fleet.manager.pid)), now
        if kill >= 0 and watch.killed_host < 0 and now - begun > kill_after_s \
                and watch.started() > 0.95:
            watch.kill(fleet.hosts[kill], fleet.host_index[kill])
    return watch, peak


# ---- the measurements ------------------------------------------------------------------------


def metric_sum(text: str, prefix: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(prefix))


def buckets(text: str, name: str) -> dict[float, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith(f"{name}_bucket{{"):
            bound = line.split('le="', 1)[1].split('"', 1)[0]
            out[float(bound)] = float(line.rsplit(" ", 1)[1])
    return out


def histogram_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """Prometheus's histogram_quantile over the increase between two scrapes (linear within a
    bucket; the top finite bound when it falls in +Inf)."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    total = counts[-1]
    if total <= 0:
        return float("nan")
    rank, lower, below = q * total, 0.0, 0.0
    for bound, cumulative in zip(bounds, counts):
        if cumulative >= rank:
            if bound == float("inf"):
                return lower
            inside = cumulative - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = bound, cumulative
    return lower


def etcd_metrics(fleet: Fleet) -> str:
    url = f"http://{etcd_of(fleet.stack).endpoint}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        return reply.read().decode()


@dataclass
class Snapshot:
    at: float
    cpu: float
    manager: str
    etcd: str

    @classmethod
    def take(cls, fleet: Fleet) -> Snapshot:
        return cls(time.monotonic(), cpu_seconds(fleet.manager.pid), scrape(fleet.metrics),
                   etcd_metrics(fleet))


def pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) * 1000 if len(values) else float("nan")


async def measured_step(fleet: Fleet, n: int, args: argparse.Namespace
                        ) -> tuple[StepWatch, int, np.ndarray]:
    """The step through the manager and, at the same time, a direct read of one worker."""
    direct = step_request("direct-", args.requests_per_worker, args.max_tokens)
    through = step_request("m-", n * args.requests_per_worker, args.max_tokens)
    (watch, peak), alone = await asyncio.gather(run_step(fleet, through),
                                                direct_latency(fleet.direct, direct))
    return watch, peak, np.asarray(alone)


def measure(n: int, args: argparse.Namespace, profile: bool) -> dict:
    fleet = start_fleet(n, args, profile)
    try:
        asyncio.run(run_step(fleet, step_request("warm-", n, 8)))
        idle = idle_cpu_rate(fleet.manager.pid, 3.0)
        rss0, before, client0 = rss_bytes(fleet.manager.pid), Snapshot.take(fleet), \
            time.process_time()
        watch, peak, direct = asyncio.run(measured_step(fleet, n, args))
        after, client = Snapshot.take(fleet), time.process_time() - client0
        doomed = step_request("k-", n * args.requests_per_worker, args.max_tokens)
        length = LongTail(args.median_tokens, args.sigma)
        lengths = np.array([length(r.request_id, args.max_tokens) for r in doomed.requests])
        killed, _ = asyncio.run(run_step(fleet, doomed, kill=0, kill_after_s=args.kill_after_s,
                                         lengths=lengths))
    finally:
        profile_path = stop_fleet(fleet)
    wall, requests = after.at - before.at, n * args.requests_per_worker
    ticks = (buckets(before.manager, "rlh_manager_tick_seconds"),
             buckets(after.manager, "rlh_manager_tick_seconds"))
    delta = {name: metric_sum(after.etcd, name) - metric_sum(before.etcd, name)
             for name in ("grpc_server_msg_received_total",
                          "etcd_server_proposals_committed_total")}
    return {
        "n": n, "requests": requests, "completed": int(watch.done.sum()),
        "failed": watch.failed + killed.failed, "tokens": watch.tokens, "wall": wall,
        "cpu": after.cpu - before.cpu, "idle": idle, "client_cpu": client,
        "slower": dilation(n, args), "real_rate": real_rate(n, args),
        **latencies(watch.all_latencies(), direct),
        "tick_p50": histogram_quantile(*ticks, 0.5) * 1000,
        "tick_p99": histogram_quantile(*ticks, 0.99) * 1000,
        "ticks": metric_sum(after.manager, "rlh_manager_tick_seconds_count") -
        metric_sum(before.manager, "rlh_manager_tick_seconds_count"),
        "tick_s": metric_sum(after.manager, "rlh_manager_tick_seconds_sum") -
        metric_sum(before.manager, "rlh_manager_tick_seconds_sum"),
        "rss_per_request": (peak - rss0) / requests, "rss0": rss0,
        "etcd_msgs": delta["grpc_server_msg_received_total"] / wall,
        "etcd_proposals": delta["etcd_server_proposals_committed_total"] / wall,
        **kill_recovery(killed, fleet), "profile": profile_path,
    }


def idle_cpu_rate(pid: int, seconds: float) -> float:
    """The manager's CPU share with every worker connected and no step: its timers (ticks,
    watches, leases), a cost per second rather than per token."""
    cpu0 = cpu_seconds(pid)
    time.sleep(seconds)
    return (cpu_seconds(pid) - cpu0) / seconds


def latencies(through: np.ndarray, direct: np.ndarray) -> dict:
    return {"through_p50": pct(through, 50), "through_p99": pct(through, 99),
            "direct_p50": pct(direct, 50), "direct_p99": pct(direct, 99)}


def kill_recovery(watch: StepWatch, fleet: Fleet) -> dict:
    """Kill to every victim running again: as the surviving workers saw it (their resumed
    AddRequests, written at exit) and as the client saw it (their tokens from elsewhere)."""
    resumed: dict[str, list[float]] = {}
    for path in fleet.stack.log_dir.glob("resumes*.json"):
        for request_id, times in json.loads(path.read_text()).items():
            resumed.setdefault(request_id, []).extend(times)
    ids = [request_id for request_id, i in watch.index.items() if watch.victims[i]]
    again = np.array([min((t for t in resumed.get(r, ()) if t > watch.killed_at), default=np.inf)
                      for r in ids])
    finite = again[~np.isinf(again)]
    tokens_back, victims, never = watch.recovery_s()
    return {"victims": victims, "never_back": never, "tokens_back": tokens_back,
            "running_again": finite.max() - watch.killed_at if len(finite) else float("nan"),
            "never_resumed": int(np.isinf(again).sum()),
            "kill_completed": int(watch.done.sum()), "regenerated": watch.regenerated}


# ---- the report ------------------------------------------------------------------------------


def table(rows: list[dict], args: argparse.Namespace) -> list[str]:
    def line(label: str, fmt) -> str:
        return f"| {label} | " + " | ".join(fmt(r) for r in rows) + " |"

    def full_step(r: dict) -> float:
        return (args.step_a_s + args.step_b_s * args.requests_per_worker) * r["slower"] * 1000

    def per_token(r: dict) -> float:
        """The relay's cost: less the idle timers' and the ticks' (a cost per second that grows
        with the requests in flight, not with the token rate; the run's pace is slowed, so
        counting it per token would inflate the per-token cost by the slowdown)."""
        return max(0.0, r["cpu"] - r["idle"] * r["wall"] - r["tick_s"]) / r["tokens"]

    return [
        "| N workers | " + " | ".join(str(r["n"]) for r in rows) + " |",
        "| --- |" + " --- |" * len(rows),
        line("requests per step (completed)", lambda r: f"{r['requests']:,} ({r['completed']:,})"),
        line("tokens relayed; step wall time",
             lambda r: f"{r['tokens']:,}; {r['wall']:.1f} s"),
        line("model's rate (full batches); run slower by", lambda r: f"{r['real_rate']:,.0f} "
             f"tok/s; x{r['slower']:.1f} (step {full_step(r):.0f} ms)"),
        line("manager CPU share idle (N workers, no step)", lambda r: f"{r['idle']:.3f} cores"),
        line("manager time in ticks (share of the step's wall time)",
             lambda r: f"{r['tick_s']:.1f} s ({r['tick_s'] / r['wall']:.2f})"),
        line("manager CPU per relayed token, less idle and ticks", lambda r: f"**{per_token(r) * 1e6:.1f} µs**"),
        line("manager CPU share at the run's pace; client's", lambda r: f"{r['cpu'] / r['wall']:.2f}"
             f"; {r['client_cpu'] / r['wall']:.2f} cores"),
        line("manager cores needed at the model's rate: relay + ticks",
             lambda r: f"**{r['real_rate'] * per_token(r) + r['tick_s'] / r['wall']:.1f}**"),
        line("delivery p50 / p99, direct read", lambda r: f"{r['direct_p50']:.1f} / "
                                                           f"{r['direct_p99']:.1f} ms"),
        line("delivery p50 / p99, through the manager", lambda r: f"{r['through_p50']:.1f} / "
                                                                   f"{r['through_p99']:.1f} ms"),
        line("added p99", lambda r: f"**{r['through_p99'] - r['direct_p99']:.1f} ms**"),
        line("tick p50 / p99 (ticks)", lambda r: f"{r['tick_p50']:.2f} / **{r['tick_p99']:.1f}** "
                                                 f"ms ({r['ticks']:,.0f})"),
        line("manager RSS idle; per request in flight",
             lambda r: f"{r['rss0'] / 2**20:.0f} MiB; {r['rss_per_request'] / 1024:.1f} KiB"),
        line("etcd gRPC messages/s (proposals/s)",
             lambda r: f"{r['etcd_msgs']:.0f} ({r['etcd_proposals']:.1f})"),
        line("SIGKILL of one worker process: its requests in flight", lambda r: f"{r['victims']:,}"),
        line("kill -> every one resumed on a survivor", lambda r: f"**{r['running_again']:.2f} s**"
             + (f" ({r['never_resumed']} never)" if r["never_resumed"] else "")),
        line("kill -> every one's tokens at the client",
             lambda r: f"{r['tokens_back']:.2f} s" + (f" ({r['never_back']} never)"
                                                     if r["never_back"] else "")),
        line("kill step: completed, failed, tokens regenerated",
             lambda r: f"{r['kill_completed']:,}, {r['failed']}, {r['regenerated']}"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N=64, 8 requests each")
    parser.add_argument("--sizes", default="64,256,1024")
    parser.add_argument("--requests-per-worker", type=int, default=16)
    parser.add_argument("--box-tokens-per-s", type=float, default=2000, help="the pace this "
                        "machine sustains: workers run slower than the model to offer this")
    parser.add_argument("--capacity", type=int, default=64, help="each worker's slots")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--median-tokens", type=float, default=8)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--step-a-s", type=float, default=0.02, help="engine step a + b * batch")
    parser.add_argument("--step-b-s", type=float, default=0.00025)
    parser.add_argument("--balancer", default="algorithm2")
    parser.add_argument("--lease-ttl", type=int, default=5, help="each worker's etcd lease "
                        "(a real worker's default: 5 s)")
    parser.add_argument("--kill-after-s", type=float, default=1.0,
                        help="the kill step: SIGKILL one worker process this far into it")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    sizes = [64] if args.quick else [int(s) for s in args.sizes.split(",")]
    if args.quick:
        args.requests_per_worker = 8
    rows = []
    for n in sizes:  # each N's figures as they come: a later N may take minutes
        rows.append(measure(n, args, args.profile and n == max(sizes)))
        print("\n".join(table(rows[-1:], args)) + "\n", flush=True)
    load = os.getloadavg()[0]
    header = (f"requests per worker {args.requests_per_worker} (log-normal lengths, median "
              f"{args.median_tokens:g}, sigma {args.sigma:g}, cap {args.max_tokens}); engine step "
              f"{args.step_a_s * 1000:g} ms + {args.step_b_s * 1000:g} ms x batch (the model; each N runs it "
              f"slower, to offer this box about {args.box_tokens_per_s:,.0f} tokens/s); balancer "
              f"{args.balancer}; machine: {os.cpu_count()} cores shared by the manager, the "
              f"worker processes, etcd, the client and other jobs (load {load:.1f} at the end)")
    lines = [header, "", *table(rows, args)]
    print("\n".join(lines))
    for r in rows:
        if r["profile"] is not None:
            print(f"\nmanager profile at N={r['n']} (top 30 by own time):")
            pstats.Stats(str(r["profile"])).sort_stats("tottime").print_stats(30)
    if not args.quick and not args.no_write and not args.profile:
        RESULTS.write_text("# Rollout manager at scale: 64 to 1,024 synthetic workers\n\n"
                           f"`python bench/manager_scale.py --sizes {args.sizes} "
                           f"--requests-per-worker {args.requests_per_worker}`\n\n"
                           + "\n".join(lines) + "\n")
    assert all(r["failed"] == 0 and r["completed"] == r["requests"] for r in rows), rows


if __name__ == "__main__":
    main()
