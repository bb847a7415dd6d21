"""The compose stack in containers, as `make test-containers` runs it (tools/containers.sh stage):
the images `make image` built, docker-compose.yml with deploy/compose/ci.yml on top, brought up
with Compose v2, a job trained, a worker container killed mid-step, the co-executor's OpenAI API
and Prometheus asked from the host, the README's gRPC client run against the manager, and `down`
checked to leave nothing behind. The tests run in file order on one stack."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import grpc
import pytest

from rlharvest.common.pb import rollout_manager_pb2 as mpb
from rlharvest.common.pb import rollout_manager_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = os.environ.get("RLH_COMPOSE", "").split()
PROJECT = "rlharvest-ci"
FILES = ["-f", "docker-compose.yml", "-f", "deploy/compose/ci.yml"]
# Everything but Grafana (no Debian package) and the `ranks` profile's trainer.
SERVICES = ["etcd", "prometheus", "transfer-agent-0", "rollout-manager", "rollout-manager-standby",
            "placement-scheduler", "rollout-worker-0", "rollout-worker-1", "rollout-worker-spot",
            "coexecutor-0", "trainer", "etcd-maintenance"]
MANAGERS = ["127.0.0.1:50200", "127.0.0.1:50201"]  # manager-0 and its standby (ci.yml)
MANAGER_METRICS = {"127.0.0.1:50200": 9200, "127.0.0.1:50201": 9201}  # their metrics (ci.yml)
STEPS = 8  # RLH_STEPS in ci.yml
KILLED = "rollout-worker-spot"  # the service; SPOT, its worker id
SPOT = "worker-spot"

pytestmark = pytest.mark.skipif(
    os.environ.get("RLH_CONTAINER_STAGE") != "1" or not COMPOSE,
    reason="the container stage: `make test-containers` builds the images, starts an engine and "
           "runs these (skipped there, with the reason, where no container engine can start)")

RESULTS: dict = {}


def compose(*args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*COMPOSE, "-p", PROJECT, *FILES, *args], cwd=ROOT, check=check,
                          capture_output=True, text=True, timeout=timeout)


def _get(url: str, timeout: float = 5) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read()


def _metric(port: int, name: str, labels: str = "") -> float | None:
    """A sample of the service whose metrics port the compose file publishes on ``port``."""
    try:
        text = _get(f"http://127.0.0.1:{port}/metrics").decode()
    except OSError:
        return None
    pattern = re.escape(name) + (r"\{" + re.escape(labels) + r"\}" if labels else r"(\{\})?")
    match = re.search(r"^" + pattern + r" (?P<value>[0-9.e+-]+)$", text, re.M)
    return float(match.group("value")) if match else None


def _leader() -> tuple[str, mpb.ManagerStatus] | None:
    """The manager that leads the job: the one whose status lists the job's workers."""
    for endpoint in MANAGERS:
        try:
            with grpc.insecure_channel(endpoint) as channel:
                stub = rollout_manager_pb2_grpc.RolloutManagerStub(channel)
                status = stub.GetStatus(mpb.GetStatusRequest(), timeout=3)
        except grpc.RpcError:
            continue
        if status.workers:
            return endpoint, status
    return None


def _wait(what: str, probe, timeout: float, every: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(every)
    logs = compose("logs", "--no-color", "--tail", "30", check=False).stdout
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}\n{logs[-12000:]}")


@pytest.fixture(scope="module")
def stack():
    compose("down", "--volumes", "--remove-orphans", "--timeout", "5", check=False)
    started = time.monotonic()
    up = compose("up", "--detach", "--pull", "never", "--no-build", *SERVICES, check=False)
    assert up.returncode == 0, up.stderr
    RESULTS["up_s"] = round(time.monotonic() - started, 1)
    try:
        yield
    finally:
        logs = compose("logs", "--no-color", "--timestamps", check=False)
        (ROOT / "build" / "containers").mkdir(parents=True, exist_ok=True)
        (ROOT / "build" / "containers" / "compose.log").write_text(logs.stdout + logs.stderr)
        compose("down", "--volumes", "--remove-orphans", "--timeout", "10", check=False)
        print(f"\ncontainer stage: {json.dumps(RESULTS)}")


def test_a_job_trains_and_a_worker_killed_holding_generated_tokens_regenerates_none(stack):
    started = time.monotonic()
    # The first step applied: every member joined, loaded version 0 and served a whole step.
    _wait("the trainer's first step", lambda: (_metric(9400, "rlh_trainer_step") or 0) >= 1, 480)
    RESULTS["first_step_s"] = round(time.monotonic() - started, 1)

    container = compose("ps", "--quiet", KILLED).stdout.strip()  # looked up before the wait

    def spot_executes_requests():
        # Executing on the manager: the spot worker produced tokens of them on this assignment
        # (pending ones have none yet), so the kill lands while it holds generated tokens.
        step = _metric(9400, "rlh_trainer_step") or 0
        if step >= STEPS - 1:
            pytest.fail(f"the spot worker executed no request in steps 2..{STEPS - 1}")
        leader = _leader()
        if leader is None:
            return None
        metrics_port = MANAGER_METRICS[leader[0]]
        assigned = _metric(metrics_port, "rlh_manager_assigned_requests", f'worker="{SPOT}"')
        pending = _metric(metrics_port, "rlh_manager_pending_requests", f'worker="{SPOT}"')
        executing = int((assigned or 0) - (pending or 0))
        return (step, leader[1], executing) if executing > 0 else None

    killed_at, before, executing = _wait("the spot worker executing a step's requests",
                                         spot_executes_requests, 240, every=0.2)
    subprocess.run(["docker", "kill", container], check=True, capture_output=True, timeout=30)
    RESULTS["killed_in_step"] = int(killed_at) + 1
    RESULTS["spot_executing_at_kill"] = executing
    RESULTS["spot_requests_at_kill"] = [w.assigned for w in before.workers
                                        if w.worker_id == SPOT][0]
    _wait(f"step {STEPS}", lambda: (_metric(9400, "rlh_trainer_step") or 0) >= STEPS, 480)
    RESULTS["steps_s"] = round(time.monotonic() - started, 1)

    endpoint, status = _wait("the leading manager", _leader, 30)
    RESULTS.update(leader=endpoint, migrations=status.migrations,
                   tokens_generated=status.tokens_generated,
                   tokens_regenerated=status.tokens_regenerated)
    assert status.tokens_regenerated == 0
    assert status.migrations > before.migrations, "the killed worker's requests moved"
    assert status.failures == before.failures, "no request failed"
    assert _metric(9400, "rlh_trainer_steps_total", 'outcome="failed"') in (None, 0.0)
    assert _metric(9400, "rlh_trainer_steps_total", 'outcome="applied"') == STEPS
    RESULTS["steps_retried"] = _metric(9400, "rlh_trainer_steps_total", 'outcome="retried"') or 0


def test_the_coexecutors_openai_api_answers_the_official_client_from_the_host(stack):
    import openai

    client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused", max_retries=2)
    model = client.models.list().data[0].id
    whole = client.completions.create(model=model, prompt="12+34=", max_tokens=8, seed=7,
                                      temperature=0)
    assert whole.choices[0].text and whole.usage.completion_tokens > 0
    chunks = client.chat.completions.create(model=model, max_tokens=6, stream=True,
                                            messages=[{"role": "user", "content": "1+1="}])
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    RESULTS["openai_model"] = model


def test_prometheus_scrapes_every_member(stack):
    def query(expr: str) -> dict[str, float]:
        url = "http://127.0.0.1:9090/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        body = json.loads(_get(url))
        return {r["metric"]["member"]: float(r["value"][1]) for r in body["data"]["result"]}

    # Every member of the compose stack's scrape job was up at some point (the killed worker
    # only until its kill), and all but the killed one are up now.
    members = {t["labels"]["member"] for t in
               json.loads(_get("http://127.0.0.1:9090/api/v1/targets"))["data"]["activeTargets"]
               if t["labels"]["job"] == "rlharvest"}
    assert len(members) == 10  # the nine services' and the etcd maintainer's
    ever = _wait("every member scraped", lambda: (lambda r: r if set(r) == members and
                 all(v == 1 for v in r.values()) else None)(
                     query('max_over_time(up{job="rlharvest"}[15m])')), 60, every=2)
    alive = members - {SPOT}
    _wait("the killed worker's scrapes failing, the others' not", lambda: {
        m for m, v in query('up{job="rlharvest"}').items() if v == 1} == alive, 60, every=2)
    # What the members export arrives: the trainer's steps and the leader's tokens.
    assert query('rlh_trainer_step{job="rlharvest"}')["trainer-0"] >= STEPS
    RESULTS["prometheus_members"] = sorted(ever)


def test_the_readme_grpc_client_generates_on_the_manager(stack):
    readme = (ROOT / "README.md").read_text()
    code = re.search(r"## The gRPC API.*?```python\n(.*?)```", readme, re.S).group(1)
    endpoint, _ = _wait("the leading manager", _leader, 30)
    code = code.replace('"localhost:50200"', f'"{endpoint}"')
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert run.returncode == 0, run.stderr
    request_id, tokens, finish = re.match(r"(\S+) \[(.*)\] (\S+)", run.stdout).groups()
    assert request_id == "r0" and finish in {"length", "stop"} and tokens


def test_down_leaves_no_container_network_or_volume(stack):
    compose("down", "--volumes", "--remove-orphans", "--timeout", "10")
    label = f"label=com.docker.compose.project={PROJECT}"
    for kind in (["ps", "-a"], ["network", "ls"], ["volume", "ls"]):
        left = subprocess.run(["docker", *kind, "--quiet", "--filter", label], check=True,
                              capture_output=True, text=True).stdout.split()
        assert not left, f"docker {' '.join(kind)} after down: {left}"
