"""`make chaos MINUTES=N` (`python -m rlharvest.cli.chaos`): a seeded chaos soak of the
local stack while GRPO trains.

The stack: etcd, a transfer agent, the job's leading manager and its standby, three workers, a
serving co-executor the job borrows and a trainer that checkpoints every step. Every 3-7 s
(seeded: ``chaos_plan.FaultPlan``) one of them is SIGKILLed at a random instant — a worker (a
new one replaces it), the leading manager (a new standby starts), the agent (started again),
etcd (started again on its data after 2-5 s), the co-executor (started again) or the trainer
(started again; it resumes from its checkpoint) — or the trainer is SIGKILLed the moment its log
says a step's optimizer step is done, before that step's checkpoint. At the end it checks what the
project promises: the trained lineage is steps 1..N once each on increasing versions, no token
was regenerated, no step saw a completion of another version, one manager leads, and no process
exited by itself. Prints the faults survived per kind; exit status 1 when a check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TypeVar

import aetcd
import aetcd.rpc

from rlharvest.common import keys, observability, registry
from rlharvest.common.etcd_maintenance import MaintenanceConfig
from rlharvest.common.local_etcd import LocalEtcd, free_port
from rlharvest.cli.chaos_plan import (
    KINDS, STEP_LINE, Fault, FaultPlan, applied_lineage, lineage_problems, unsaved_step)
from rlharvest.cli.launcher import LocalStack, ServiceProcess

log = logging.getLogger("rlharvest.chaos")
T = TypeVar("T")
COMMON = ["--lease-ttl", "2", "--json-logs"]
WORKERS = 3


@dataclass
class Soak:
    """The stack under test and what the soak did to it."""

    stack: LocalStack
    etcd: LocalEtcd
    trainer_flags: list[str]
    killed: set[int] = field(default_factory=set)  # ids of the processes the soak killed
    faults: Counter = field(default_factory=Counter)
    regenerated: dict[str, float] = field(default_factory=dict)  # manager -> highest seen
    serial: int = 0
    # when, raft index, database bytes in use, database file bytes, revision
    etcd_samples: list[tuple[float, int, int, int, int]] = field(default_factory=list)
    checkpoint_dir: Path = Path()
    # trainer-before-save kills: step -> whether the kill landed before that step's checkpoint
    before_save: dict[int, bool] = field(default_factory=dict)

    def name(self, prefix: str) -> str:
        self.serial += 1
        return f"{prefix}-{self.serial}"

    def live(self, service: str) -> list[ServiceProcess]:
        return [p for p in self.stack.processes if p.service == service and p.alive()]

    def kill(self, proc: ServiceProcess) -> None:
        self.killed.add(id(proc))
        proc.kill()


def start_manager(soak: Soak) -> ServiceProcess:
    name = soak.name("manager")
    return soak.stack.start("rollout_manager", name, [
        "--manager-id", name, "--port", str(free_port()), "--metrics-port", str(free_port()),
        "--stall-timeout-s", "5", "--max-serving-workers", "1", *COMMON])


def start_coexecutor(soak: Soak) -> ServiceProcess:
    """A serving co-executor the job borrows through etcd (the lending claim), as in the demo;
    no serving traffic: the soak is about the job's rollouts surviving it."""
    name = soak.name("coexec")
    return soak.stack.start("coexecutor", name, [
        "--coexec-id", name, "--agent-pull", "--http-port", str(free_port()), "--metrics-port",
        str(free_port()), "--serving-model", "tiny", "--served-model-name", "served",
        "--torch-threads", "1", *COMMON])


def start_worker(soak: Soak) -> ServiceProcess:
    name = soak.name("worker")
    return soak.stack.start("rollout_worker", name, [
        "--worker-id", name, "--torch-threads", "1", "--job", "default", "--agent-pull",
        "--metrics-port", str(free_port()), *COMMON])


def start_agent(soak: Soak) -> ServiceProcess:
    return soak.stack.start("transfer_agent", "agent", ["--agent-id", "agent-0", *COMMON])


def start_trainer(soak: Soak) -> ServiceProcess:
    return soak.stack.start("trainer", "trainer", soak.trainer_flags)


async def _ask_etcd(soak: Soak, ask: Callable[[aetcd.Client], Awaitable[T]]) -> T:
    """``ask(client)`` on a client of its own: etcd restarts under the soak, none is kept."""
    client = await registry.connect(soak.etcd.endpoint)
    try:
        return await ask(client)
    finally:
        await client.close()


async def manager_roles(soak: Soak) -> dict[str, str]:
    """Manager id -> the role its member record states."""
    members = await _ask_etcd(soak, partial(registry.list_members, service="rollout_manager"))
    return {keys.parse_member_key(key)[1]: str(info.get("role")) for key, info in members.items()}


async def leader(soak: Soak) -> ServiceProcess | None:
    """The process of the manager whose record says it leads (None during a failover)."""
    roles = await manager_roles(soak)
    return next((p for p in soak.live("rollout_manager") if roles.get(p.name) == "leader"),
                None)


async def inject(soak: Soak, fault: Fault) -> bool:
    """One fault; False when its target was not there to hit (counted as skipped)."""
    kind = fault.kind
    if kind == "worker":
        workers = soak.live("rollout_worker")
        if not workers:
            return False
        soak.kill(workers[int(fault.pick * len(workers))])
        start_worker(soak)
    elif kind == "leader":
        target = await _quietly(leader(soak))
        if target is None:
            return False
        soak.kill(target)
        start_manager(soak)  # the standby leads; this one stands by
    elif kind == "agent":
        for agent in soak.live("transfer_agent"):
            soak.kill(agent)
        start_agent(soak)
    elif kind == "etcd":
        await asyncio.to_thread(soak.etcd.restart, crash=True, down_s=fault.down_s)
    elif kind == "trainer":
        for trainer in soak.live("trainer"):
            soak.kill(trainer)
        start_trainer(soak)
    elif kind == "trainer-before-save":
        return await kill_trainer_before_save(soak)
    elif kind == "coexecutor":
        for coexecutor in soak.live("coexecutor"):
            soak.kill(coexecutor)
        start_coexecutor(soak)
    return True


async def kill_trainer_before_save(soak: Soak, within_s: float = 30.0) -> bool:
    """SIGKILL the trainer the moment its log says a step trained (the optimizer step done)
    that it has not checkpointed yet, then start it again; False when no step ended within
    ``within_s``. A kill that came after the checkpoint after all is counted apart."""
    log_path = soak.stack.log_dir / "trainer.log"
    offset = log_path.stat().st_size if log_path.exists() else 0
    deadline = time.monotonic() + within_s
    step = None
    while step is None:
        if time.monotonic() > deadline or not soak.live("trainer"):
            return False
        await asyncio.sleep(0.005)
        step = unsaved_step(_messages(log_path, offset))
    for trainer in soak.live("trainer"):
        soak.kill(trainer)
    saved = (soak.checkpoint_dir / f"step-{step}").exists()
    soak.before_save[step] = not saved
    start_trainer(soak)
    return True


def _messages(path: Path, offset: int = 0) -> list[str]:
    """The ``msg`` of each JSON log line of ``path`` from ``offset`` on (a line being written
    is skipped)."""
    with open(path, "rb") as log_file:
        log_file.seek(offset)
        lines = log_file.read().decode(errors="replace").splitlines()
    out = []
    for line in lines:
        try:
            out.append(json.loads(line).get("msg", ""))
        except ValueError:
            continue
    return out


async def _quietly(aw):
    """``aw``'s result, None when etcd is away (an etcd fault just before)."""
    try:
        return await asyncio.wait_for(aw, 5)
    except Exception:
        return None


def scrape_regenerated(soak: Soak) -> None:
    """Each manager's tokens regenerated so far (read often: a killed one's count goes with
    it)."""
    for proc in soak.live("rollout_manager"):
        try:
            text = observability.scrape(f"127.0.0.1:{_flag(proc, '--metrics-port')}", timeout=1)
        except OSError:
            continue
        value = observability.sample(text, "rlh_manager_tokens_regenerated")
        soak.regenerated[proc.name] = max(value, soak.regenerated.get(proc.name, 0.0))


def _flag(proc: ServiceProcess, flag: str) -> str:
    args = proc.process.args if isinstance(proc.process.args, list) else []
    return str(args[args.index(flag) + 1]) if flag in args else "0"


async def sample_etcd(soak: Soak) -> None:
    """etcd's raft index (its writes and lease grants), the database's bytes in use (what
    compaction frees) and its file size (what a defrag shrinks), for the report."""
    async def ask(client: aetcd.Client) -> aetcd.rpc.StatusResponse:
        return await client.maintenancestub.Status(aetcd.rpc.StatusRequest(), timeout=5)

    status = await _quietly(_ask_etcd(soak, ask))
    if status is not None:
        soak.etcd_samples.append((time.monotonic(), status.raftIndex, status.dbSizeInUse,
                                  status.dbSize, status.header.revision))


def etcd_growth(samples: list[tuple[float, int, int, int, int]]) -> str:
    if len(samples) < 2:
        return "etcd: not sampled"
    (t0, raft0, *_), (t1, raft1, *_) = samples[0], samples[-1]
    rate = (raft1 - raft0) / max(t1 - t0, 1e-9) * 60
    revisions = by_minute(samples, 4, unit=1)
    written = [b - a for a, b in zip([samples[0][4], *revisions], revisions)]
    return (f"etcd: {rate:.0f} raft entries a minute; revisions written each minute "
            f"{', '.join(f'{n:.0f}' for n in written)}; at each minute's end, database in use "
            f"{_kib(by_minute(samples, 2))} KiB, file {_kib(by_minute(samples, 3))} KiB "
            f"(largest in use {max(s[2] for s in samples) / 1024:.0f} KiB, "
            f"file {max(s[3] for s in samples) / 1024:.0f} KiB)")


def _kib(values: list[float]) -> str:
    return ", ".join(f"{kib:.0f}" for kib in values)


def by_minute(samples: list[tuple[float, int, int, int, int]], column: int = 2,
              unit: int = 1024) -> list[float]:
    """A column (sizes in KiB) last sampled in each minute of the soak: whether the sizes level
    off once compaction drops revisions older than the retention (and a defrag free pages)."""
    last: dict[int, float] = {}
    for sample in samples:
        last[int((sample[0] - samples[0][0]) // 60)] = sample[column] / unit
    return [last[m] for m in sorted(last)]


def key_class(key: str) -> str:
    """Who writes ``key``: its first component under ``keys.ROOT``, two for members/ (the
    service) — e.g. members/rollout_worker, pairing, jobs, weights."""
    parts = key.removeprefix(keys.ROOT + "/").split("/")
    return "/".join(parts[:2] if parts[0] == "members" else parts[:1])


async def write_mix(soak: Soak, since: int) -> tuple[Counter, int]:
    """The revisions from ``since`` to now by key class (a watch replays the history etcd still
    keeps: the maintainer's compaction leaves ``--keep-s`` of it), and the last revision."""
    async def replay(client: aetcd.Client) -> tuple[Counter, int]:
        now = (await client.get_range(keys.ROOT.encode(), keys.ROOT.encode() + b"\xff")
               ).header.revision
        mix: Counter = Counter()
        if now <= since:
            return mix, now
        watch = await client.watch(b"\0", range_end=b"\0", start_revision=since + 1)
        try:
            async for event in watch:
                mix[key_class(event.kv.key.decode(errors="replace"))] += 1
                if event.kv.mod_revision >= now:
                    break
        finally:
            await watch.cancel()
        return mix, now

    return await asyncio.wait_for(_ask_etcd(soak, replay), 30)


def mix_report(mix: Counter, minutes: float, workers: int, steps: int) -> str:
    total = sum(mix.values())
    parts = ", ".join(f"{k} {n / minutes:.0f}" for k, n in mix.most_common())
    worker_keys = mix["members/rollout_worker"] + mix["pairing"]
    return (f"etcd writes by key over the last {minutes:.1f} min (a minute): {parts}; "
            f"{total / minutes:.0f} in all, {worker_keys / minutes / workers:.1f} per worker "
            f"(members/rollout_worker, pairing), "
            + (f"{total / steps:.1f} per step trained ({steps} steps)" if steps else
               "no step trained"))


def per_step_writes(samples: list[tuple[float, int, int, int, int]], steps: int) -> str:
    """etcd writes (raft entries, lease grants and renewals included) per step trained."""
    if len(samples) < 2 or steps < 1:
        return "no step to divide by"
    return f"{(samples[-1][1] - samples[0][1]) / steps:.0f} raft entries per step trained"


async def recovered(soak: Soak, within_s: float) -> None:
    """Until the trainer logs a step trained after the last fault (and 2 s more, for the
    managers' and workers' records to settle), at most ``within_s``."""
    log_path = soak.stack.log_dir / "trainer.log"
    offset = log_path.stat().st_size if log_path.exists() else 0
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if any(STEP_LINE.match(m) for m in _messages(log_path, offset)):
            await asyncio.sleep(2.0)
            return
        scrape_regenerated(soak)
        await asyncio.sleep(0.5)


def trainer_messages(soak: Soak) -> list[str]:
    return _messages(soak.stack.log_dir / "trainer.log")


async def soak(minutes: float, seed: int, workdir: Path, kinds: tuple[str, ...] = KINDS,
               compaction: str = "5m", maintenance: MaintenanceConfig | None = None,
               workers: int = WORKERS) -> int:
    """``maintenance``: the launcher compacts and defragments etcd so (None: etcd's own
    periodic compaction only)."""
    etcd = await asyncio.to_thread(LocalEtcd(log_path=workdir / "etcd.log",
                                             compaction_retention=compaction).start)
    stack = LocalStack(workdir / "logs", etcd=etcd)
    if maintenance is not None:
        stack.start_etcd_maintenance(maintenance, period_s=5.0)
    trainer_flags = ["--trainer-id", "trainer-0", "--port", str(free_port()), "--backend", "torch",
                     "--torch-threads", "1", "--checkpoint-dir", str(workdir / "checkpoints"),
                     "--checkpoint-every", "1", "--no-exit-when-done", *COMMON]
    run = Soak(stack, etcd, trainer_flags, checkpoint_dir=workdir / "checkpoints")
    plan = FaultPlan(seed, kinds=kinds)
    try:
        start_agent(run)
        start_manager(run)
        start_manager(run)
        for _ in range(workers):
            start_worker(run)
        start_coexecutor(run)
        start_trainer(run)
        await sample_etcd(run)
        deadline = time.monotonic() + minutes * 60
        while True:
            fault = plan.next()
            if time.monotonic() + fault.after_s > deadline:
                break
            until = time.monotonic() + fault.after_s
            while time.monotonic() < until:
                scrape_regenerated(run)
                await asyncio.sleep(0.5)
            await sample_etcd(run)
            hit = await inject(run, fault)
            run.faults[fault.kind if hit else f"{fault.kind} (skipped)"] += 1
            log.info("fault: %s%s", fault.kind, "" if hit else " (no target)")
        await recovered(run, within_s=20.0)  # the last fault's recovery: a step trained since
        scrape_regenerated(run)
        await sample_etcd(run)
        roles = await _quietly(manager_roles(run))
        await report_write_mix(run, workers)
        if stack.maintenance is not None:
            kept = stack.maintenance.maintainer
            print(f"etcd maintenance: {kept.compactions} compactions (last to revision "
                  f"{kept.policy.compacted}), {kept.defrags} defrags")
        return report(run, None if roles is None else sorted(roles.values()))
    finally:
        stack.stop()


async def report_write_mix(run: Soak, workers: int) -> None:
    """Writes per key class over the history etcd kept (the last --keep-s and more): per worker
    and per step trained in that window."""
    if run.stack.maintenance is None or len(run.etcd_samples) < 2:
        return
    since = run.stack.maintenance.maintainer.policy.compacted
    start = next((s for s in run.etcd_samples if s[4] >= since), None)
    if since == 0 or start is None:
        return
    try:
        mix, _ = await write_mix(run, since)
    except Exception as exc:  # noqa: BLE001 - a figure of the report, not a check
        print(f"etcd writes by key: not replayed ({exc!r})")
        return
    minutes = (run.etcd_samples[-1][0] - start[0]) / 60
    steps = sum(1 for m in trainer_messages_since(run, start[0]) if STEP_LINE.match(m))
    print(mix_report(mix, minutes, workers, steps))


def trainer_messages_since(run: Soak, since: float) -> list[str]:
    """The trainer's log lines written after monotonic time ``since`` (their JSON ``ts``)."""
    wall = time.time() - (time.monotonic() - since)
    out = []
    for line in (run.stack.log_dir / "trainer.log").read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if float(record.get("ts", 0)) >= wall:
            out.append(record.get("msg", ""))
    return out


def report(run: Soak, roles: list[str] | None) -> int:
    messages = trainer_messages(run)
    lineage = applied_lineage(messages)
    problems = lineage_problems(lineage)
    if not lineage:
        problems.append("no step was trained")
    regenerated = sum(run.regenerated.values())
    if regenerated:
        problems.append(f"{regenerated:.0f} tokens regenerated")
    if any("another version" in m or "OnPolicyViolation" in m for m in messages):
        problems.append("a step saw a completion of another version")
    exited = [p.name for p in run.stack.processes if not p.alive() and id(p) not in run.killed]
    if exited:
        problems.append(f"exited by themselves: {exited}")
    if roles is None or roles.count("leader") != 1:
        problems.append(f"manager roles at the end: {roles}")
    print("faults survived:", ", ".join(f"{k} {n}" for k, n in sorted(run.faults.items())))
    if run.before_save:
        landed = sum(run.before_save.values())
        late = len(run.before_save) - landed
        print(f"trainer killed before a step's checkpoint: {landed} of {len(run.before_save)} "
              f"kills (steps {sorted(run.before_save)})"
              + (f"; {late} came just after the save" if late else ""))
    print(etcd_growth(run.etcd_samples), end="")
    print(f"; {per_step_writes(run.etcd_samples, len(lineage))}")
    print(f"steps trained: {len(lineage)} (lineage {lineage[:3]}...{lineage[-2:]}); "
          f"tokens regenerated: {regenerated:.0f}; manager roles: {roles}")
    for problem in problems:
        print("FAILED:", problem)
    print("chaos soak", "FAILED" if problems else "passed")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default="", help="logs and checkpoints (default: a new "
                                                      "temporary directory)")
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help=f"the faults to inject, comma-separated, among {','.join(KINDS)}")
    parser.add_argument("--compaction", default="5m",
                        help="etcd's compaction retention (the local stack's: 5m); the database "
                             "in use levels off at one to two of them")
    parser.add_argument("--keep-s", type=float, default=120.0,
                        help="the launcher's own compaction keeps this much history (0: off, "
                             "etcd's periodic compaction only); it compacts at most every "
                             "quarter of it and defragments (at most once a minute) a file "
                             "more than half free by --defrag-min-free-kib")
    parser.add_argument("--defrag-min-free-kib", type=int, default=256)
    parser.add_argument("--workers", type=int, default=WORKERS)
    args = parser.parse_args(argv)
    if args.minutes <= 0:
        parser.error("--minutes must be > 0")
    kinds = tuple(k for k in args.kinds.split(",") if k)
    if not kinds or set(kinds) - set(KINDS):
        parser.error(f"--kinds {args.kinds!r}: give some of {','.join(KINDS)}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="rlh-chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"chaos soak: {args.minutes:g} min, seed {args.seed}, logs in {workdir}")
    maintenance = None if args.keep_s <= 0 else MaintenanceConfig(
        retention_s=args.keep_s, compact_every_s=min(60.0, args.keep_s / 4),
        defrag_min_free_bytes=args.defrag_min_free_kib * 1024, defrag_every_s=60.0)
    return asyncio.run(soak(args.minutes, args.seed, workdir, kinds, args.compaction,
                            maintenance, args.workers))


if __name__ == "__main__":
    sys.exit(main())
