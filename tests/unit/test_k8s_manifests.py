"""The Kubernetes manifests in deploy/k8s, checked without a cluster or the kustomize binary.

Each Kustomize tree (the base and the gpu and tls overlays) is rendered by ``render`` below, a
small renderer of the Kustomize subset the tree uses (``resources``, ``patches`` as strategic
merge or JSON 6902 patches, with or without a ``target``); a kustomization key or a patch form
outside that subset fails the test rather than render differently from ``kustomize build``.
Every rendered object is then validated against the Kubernetes JSON schemas bundled in the
``kubernetes-validate`` package (strict: unknown fields are errors), for the oldest Kubernetes
the manifests support (gRPC probes are GA from 1.27) and the newest the package knows. Then the
manifests are checked against what the services really do: each docker-compose.yml service has a
counterpart running the same ``rlharvest-<service>`` CLI with the same settings, every service's
effective config (the ConfigMap's TOML + the pod's RLH_ variables + its flags) loads through the
service's own config model, probes hit the ports the service listens on, and grace periods
cover each service's drain and shutdown grace (and its systemd unit's TimeoutStopSec)."""

from __future__ import annotations

import configparser
import copy
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

import pytest
import torch
import yaml
from torch.distributed.run import get_args_parser as torchrun_parser

from rlharvest.common.cli import parse_flags
from rlharvest.common.config import ServiceConfig, load_config
from rlharvest.services.coexecutor.config import CoexecutorConfig
from rlharvest.services.placement_scheduler.config import PlacementConfig
from rlharvest.services.rollout_manager.config import ManagerConfig
from rlharvest.services.rollout_worker.config import WorkerConfig
from rlharvest.services.trainer.config import TrainerConfig
from rlharvest.services.transfer_agent.config import AgentConfig
from tests.unit.test_deploy import check_tool_command

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
TREES = {"base": K8S / "base", "gpu": K8S / "overlays" / "gpu", "tls": K8S / "overlays" / "tls"}
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
CONFIGS: dict[str, type[ServiceConfig]] = {
    "rlharvest-rollout-worker": WorkerConfig, "rlharvest-rollout-manager": ManagerConfig,
    "rlharvest-trainer": TrainerConfig, "rlharvest-transfer-agent": AgentConfig,
    "rlharvest-placement-scheduler": PlacementConfig, "rlharvest-coexecutor": CoexecutorConfig}
MODULES = {"rlharvest.services.trainer.main": "rlharvest-trainer"}  # what torchrun may launch
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet")

# The oldest Kubernetes these manifests are for (native gRPC probes: beta in 1.24, GA in 1.27).
MIN_KUBERNETES = "1.27"

# docker-compose.yml service -> (tree, kind, name) of its Kubernetes counterpart.
COUNTERPARTS = {
    "etcd": ("base", "StatefulSet", "etcd"),
    "rollout-worker-0": ("base", "Deployment", "rollout-worker"),
    "rollout-worker-1": ("base", "Deployment", "rollout-worker"),
    "rollout-worker-spot": ("base", "Deployment", "rollout-worker-spot"),
    "coexecutor-0": ("base", "Deployment", "coexecutor"),
    "rollout-manager": ("base", "Deployment", "rollout-manager"),
    "rollout-manager-standby": ("base", "Deployment", "rollout-manager"),  # its 2nd replica
    "placement-scheduler": ("base", "Deployment", "placement-scheduler"),
    "transfer-agent-0": ("base", "DaemonSet", "transfer-agent"),
    "trainer": ("base", "StatefulSet", "trainer"),
    "trainer-ranks": ("gpu", "StatefulSet", "trainer"),  # the compose profile "ranks"
    "etcd-maintenance": ("base", "Deployment", "etcd-maintenance-0"),  # one per etcd member
}
# Tools' subcommands deployed as workloads (`rlharvest etcd-maintain`): no service config.
TOOL = "rlharvest"
# The TLS overlay's etcd maintainers hold an admin's certificate (etcd's root role), not a service's.
ADMIN_SECRET, ADMIN_DIR = "rlharvest-etcd-admin-tls", "/etc/rlharvest-etcd-admin-tls"
# Settings each pod sets for itself (downward API), where compose names each container.
PER_POD_KEYS = {"advertise_host", "worker_id", "coexec_id", "scheduler_id", "agent_id", "node",
                "trainer_id", "manager_id"}
# What the downward API would put in a pod's environment.
FIELD_REFS = {"metadata.name": "{name}-0", "status.podIP": "10.0.0.10",
              "status.hostIP": "192.0.2.10", "spec.nodeName": "node-a"}
# RLH_ variables the tls overlay sets for the services' tls_cert / tls_key / tls_ca keys
# (deploy/k8s/README.md, "TLS"); every other RLH_ variable must name a config key, since the
# services ignore RLH_ variables that do not (a typo would be silently ignored).
TLS_ENV = {"RLH_TLS_CERT": "tls.crt", "RLH_TLS_KEY": "tls.key", "RLH_TLS_CA": "ca.crt"}
TLS_SECRET, TLS_DIR = "rlharvest-tls", "/etc/rlharvest-tls"
GPU_ROLES = {"rollout-worker": 1, "rollout-worker-spot": 1, "coexecutor": 1, "trainer": 2}


# ---- a renderer of the Kustomize subset deploy/k8s uses ------------------------------------------

class UnsupportedKustomize(Exception):
    """The tree uses Kustomize beyond this renderer's subset: extend ``render`` (and test it)."""


# Strategic merge: lists merged by a key (Kubernetes' patchMergeKey), lists replaced whole (no
# patch strategy), as the Kubernetes API declares them for the fields patched here.
_MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name", "volumes": "name",
               "volumeMounts": "mountPath"}
_REPLACED = {"command", "args", "tolerations", "nodeSelectorTerms", "matchExpressions", "values",
             "accessModes", "drop", "add"}


def _strategic_merge(base: Any, patch: Any, key: str = "") -> Any:
    if isinstance(patch, dict):
        if any(k.startswith("$") for k in patch):
            raise UnsupportedKustomize(f"strategic merge directive in {sorted(patch)}")
        out = dict(base) if isinstance(base, dict) else {}
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            else:
                out[k] = _strategic_merge(out.get(k), v, k)
        return out
    if isinstance(patch, list):
        if key in _REPLACED or not patch or not isinstance(patch[0], dict):
            return copy.deepcopy(patch)
        if key not in _MERGE_KEYS:
            raise UnsupportedKustomize(f"no merge strategy known for the list {key!r}")
        merge_key = _MERGE_KEYS[key]
        out_list = [copy.deepcopy(item) for item in base or []]
        for item in patch:
            at = next((i for i, old in enumerate(out_list)
                       if old.get(merge_key) == item[merge_key]), None)
            if at is None:
                out_list.append(copy.deepcopy(item))
            else:
                out_list[at] = _strategic_merge(out_list[at], item, key)
        return out_list
    return copy.deepcopy(patch)


def _pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise UnsupportedKustomize(f"JSON pointer {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _json_patch(doc: dict, ops: list[dict]) -> dict:
    doc = copy.deepcopy(doc)
    for op in ops:
        if op["op"] not in ("add", "replace"):
            raise UnsupportedKustomize(f"JSON patch op {op['op']!r}")
        *parents, last = _pointer(op["path"])
        node: Any = doc
        for part in parents:  # a missing parent is an error, as in RFC 6902
            node = node[int(part)] if isinstance(node, list) else node[part]
        value = copy.deepcopy(op["value"])
        if isinstance(node, list):
            if last == "-":
                node.append(value)
            elif op["op"] == "add":
                node.insert(int(last), value)
            else:
                node[int(last)] = value
        else:
            if op["op"] == "replace" and last not in node:
                raise KeyError(f"replace of a missing {op['path']}")
            node[last] = value
    return doc


def _selected(doc: dict, target: dict) -> bool:
    unknown = set(target) - {"kind", "name", "labelSelector"}
    if unknown:
        raise UnsupportedKustomize(f"patch target fields {sorted(unknown)}")
    if "kind" in target and doc["kind"] != target["kind"]:
        return False
    if "name" in target and doc["metadata"]["name"] != target["name"]:
        return False
    labels = doc["metadata"].get("labels", {})
    for term in filter(None, target.get("labelSelector", "").split(",")):
        key, eq, value = term.partition("=")
        if not eq or value.startswith("="):
            raise UnsupportedKustomize(f"label selector term {term!r} (only key=value)")
        if labels.get(key.strip()) != value.strip():
            return False
    return True


def render(directory: Path) -> list[dict]:
    """What ``kustomize build directory`` prints, as objects (order aside)."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - {"apiVersion", "kind", "resources", "patches"}
    if unknown:
        raise UnsupportedKustomize(f"{directory}: kustomization keys {sorted(unknown)}")
    assert kustomization["kind"] == "Kustomization"
    docs: list[dict] = []
    for entry in kustomization.get("resources", []):
        path = (directory / entry).resolve()
        if path.is_dir():
            docs.extend(render(path))
        else:
            docs.extend(d for d in yaml.safe_load_all(path.read_text()) if d is not None)
    ids = [(d["kind"], d["metadata"]["name"]) for d in docs]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    assert not duplicates, f"{directory}: objects defined twice: {duplicates}"
    for entry in kustomization.get("patches", []):
        if set(entry) - {"path", "target"}:
            raise UnsupportedKustomize(f"patch entry keys {sorted(entry)}")
        patch = yaml.safe_load((directory / entry["path"]).read_text())
        target = entry.get("target")
        if isinstance(patch, list) and target is None:
            raise UnsupportedKustomize(f"{entry['path']}: a JSON patch without a target")
        if target is None:  # a strategic merge patch names its object
            target = {"kind": patch["kind"], "name": patch["metadata"]["name"]}
        hits = [i for i, doc in enumerate(docs) if _selected(doc, target)]
        assert hits, f"{directory}: patch {entry['path']} ({target}) matches no object"
        for i in hits:
            docs[i] = _apply_patch(docs[i], patch)
    return docs


def _apply_patch(doc: dict, patch: dict | list) -> dict:
    """A JSON 6902 patch (a list of operations) or a strategic merge patch (an object; its
    apiVersion, kind and name select, they are not merged: a target may select others)."""
    if isinstance(patch, list):
        return _json_patch(doc, patch)
    body = {k: v for k, v in patch.items() if k not in ("apiVersion", "kind")}
    metadata = {k: v for k, v in body.pop("metadata", {}).items() if k != "name"}
    if metadata:
        body["metadata"] = metadata
    return _strategic_merge(doc, body)


# ---- helpers ---------------------------------------------------------------------------------

_RENDERED: dict[str, list[dict]] = {}


def rendered(tree: str) -> list[dict]:
    if tree not in _RENDERED:
        _RENDERED[tree] = render(TREES[tree])
    return copy.deepcopy(_RENDERED[tree])


def find(docs: list[dict], kind: str, name: str) -> dict:
    [doc] = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def workloads(docs: list[dict]) -> Iterator[dict]:
    return (d for d in docs if d["kind"] in WORKLOAD_KINDS)


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def service_argv(argv: list[str]) -> list[str]:
    """The service's own argv; a torchrun line must launch a service module (tests/unit/
    test_deploy.py reads compose's the same way)."""
    if Path(argv[0]).name != "torchrun":
        return argv
    launch = torchrun_parser().parse_args(argv[1:])
    assert launch.module and launch.training_script in MODULES, argv
    return [MODULES[launch.training_script], *launch.training_script_args]


def container_argv(container: dict) -> list[str]:
    return [*container.get("command", []), *container.get("args", [])]


def program_of(container: dict) -> str | None:
    argv = container_argv(container)
    if not argv:
        return None
    program = Path(service_argv(argv)[0]).name
    return program if program in CONFIGS else None


def service_containers(docs: list[dict]) -> Iterator[tuple[dict, dict, str]]:
    """(workload, container, program) of every rlharvest service container."""
    for workload in workloads(docs):
        for container in pod_spec(workload)["containers"]:
            program = program_of(container)
            if program is not None:
                yield workload, container, program


def _split_config_flag(args: list[str]) -> tuple[str | None, list[str]]:
    if "--config" not in args:
        return None, args
    i = args.index("--config")
    return args[i + 1], args[:i] + args[i + 2:]


def mounted_file(docs: list[dict], workload: dict, container: dict, path: str) -> str:
    """The text of ``path`` inside ``container``, when a ConfigMap volume provides it."""
    volumes = {v["name"]: v for v in pod_spec(workload).get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        prefix = mount["mountPath"].rstrip("/") + "/"
        if path.startswith(prefix) and "configMap" in volumes[mount["name"]]:
            config_map = find(docs, "ConfigMap", volumes[mount["name"]]["configMap"]["name"])
            key = path[len(prefix):]
            assert key in config_map["data"], f"{path}: no key {key} in {config_map['metadata']}"
            return config_map["data"][key]
    raise AssertionError(f"{workload['metadata']['name']}: nothing mounts {path}")


def pod_env(workload: dict, container: dict) -> dict[str, str]:
    env = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = str(var["value"])
        else:
            field = var["valueFrom"]["fieldRef"]["fieldPath"]
            env[var["name"]] = FIELD_REFS[field].format(name=workload["metadata"]["name"])
    return env


def effective_config(docs: list[dict], workload: dict, container: dict,
                     tmp_path: Path) -> ServiceConfig:
    """The config the container's service starts with: its config file from the ConfigMap, its
    RLH_ environment and its flags, loaded by the service's own loader (flags > env > file)."""
    argv = service_argv(container_argv(container))
    model = CONFIGS[Path(argv[0]).name]
    config_path, args = _split_config_flag(argv[1:])
    config_file = None
    if config_path is not None:
        config_file = tmp_path / workload["metadata"]["name"] / Path(config_path).name
        config_file.parent.mkdir(parents=True, exist_ok=True)
        config_file.write_text(mounted_file(docs, workload, container, config_path))
    gpus = int(container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))
    with pytest.MonkeyPatch.context() as mp:
        for name in [n for n in os.environ if n.upper().startswith("RLH_")]:
            mp.delenv(name)
        for name, value in pod_env(workload, container).items():
            mp.setenv(name, value)
        if gpus:  # the pod's node has the GPUs its limits ask for; this machine may have none
            mp.setattr(torch.cuda, "is_available", lambda: True)
            mp.setattr(torch.cuda, "device_count", lambda: gpus)
        return load_config(model, config_file, parse_flags(model, args))


def compose_services() -> dict[str, dict]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]


def compose_config(svc: dict) -> tuple[ServiceConfig, set[str]]:
    """A compose service's config and the keys compose sets (flags and RLH_ environment)."""
    argv = service_argv(svc["command"])
    model = CONFIGS[Path(argv[0]).name]
    flags = parse_flags(model, argv[1:])
    env = {k: str(v) for k, v in (svc.get("environment") or {}).items()}
    with pytest.MonkeyPatch.context() as mp:
        for name in [n for n in os.environ if n.upper().startswith("RLH_")]:
            mp.delenv(name)
        for name, value in env.items():
            mp.setenv(name, value)
        cfg = load_config(model, None, flags)
    set_keys = set(flags) | {k[4:].lower() for k in env if k.startswith("RLH_")}
    return cfg, set_keys


def systemd_stop_timeout(program: str) -> float:
    parser = configparser.ConfigParser(strict=True, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read(ROOT / "deploy" / "systemd" / f"{program}.service")
    return float(parser["Service"]["TimeoutStopSec"])


def shutdown_needs(cfg: ServiceConfig) -> float:
    """Seconds a service's SIGTERM path may take by its config (rlharvest/common/service_host.py teardown:
    drain, then gRPC stop within shutdown_grace)."""
    seconds = float(getattr(cfg, "shutdown_grace"))
    if isinstance(cfg, WorkerConfig):  # requests migrate within drain_timeout
        seconds += cfg.drain_timeout
    if isinstance(cfg, CoexecutorConfig):  # rollout drains, then serving finishes: each that long
        seconds += 2 * cfg.drain_timeout
    return seconds


def declared_ports(container: dict) -> dict[str | int, int]:
    ports: dict[str | int, int] = {}
    for port in container.get("ports", []):
        ports[port["containerPort"]] = port["containerPort"]
        if "name" in port:
            ports[port["name"]] = port["containerPort"]
    return ports


def _validator() -> Any:
    try:
        import kubernetes_validate
    except ImportError:
        if os.environ.get("CI"):
            raise
        pytest.skip("kubernetes-validate is not installed: pip install -e '.[dev]'")
    return kubernetes_validate


# ---- the renderer itself ---------------------------------------------------------------------

def test_renderer_merges_like_kustomize():
    base = {"spec": {"template": {"spec": {
        "tolerations": [{"key": "a", "operator": "Exists"}],
        "containers": [{"name": "c", "image": "x", "env": [{"name": "A", "value": "1"}],
                        "resources": {"requests": {"cpu": "1"}}}]}}}}
    patch = {"spec": {"template": {"spec": {
        "tolerations": [{"key": "b", "operator": "Exists"}],
        "containers": [{"name": "c", "image": "y", "env": [{"name": "B", "value": "2"}],
                        "resources": {"limits": {"nvidia.com/gpu": 1}}}]}}}}
    merged = _strategic_merge(base, patch)["spec"]["template"]["spec"]
    assert merged["tolerations"] == [{"key": "b", "operator": "Exists"}]  # replaced whole
    [container] = merged["containers"]  # merged by name
    assert container["image"] == "y"
    assert [e["name"] for e in container["env"]] == ["A", "B"]
    assert container["resources"] == {"requests": {"cpu": "1"}, "limits": {"nvidia.com/gpu": 1}}
    with pytest.raises(UnsupportedKustomize):
        _strategic_merge(base, {"spec": {"template": {"spec": {"hostAliases": [{"ip": "x"}]}}}})
    patched = _json_patch(base, [{"op": "add", "path": "/spec/template/spec/containers/0/env/-",
                                  "value": {"name": "C", "value": "3"}}])
    assert [e["name"] for e in patched["spec"]["template"]["spec"]["containers"][0]["env"]] == [
        "A", "C"]
    assert _selected({"kind": "Deployment", "metadata": {"name": "n", "labels": {"a": "b"}}},
                     {"kind": "Deployment", "labelSelector": "a=b"})
    assert not _selected({"kind": "Deployment", "metadata": {"name": "n"}},
                         {"kind": "Deployment", "labelSelector": "a=b"})


# ---- schemas ---------------------------------------------------------------------------------

@pytest.mark.parametrize("tree", sorted(TREES))
def test_every_object_is_valid_for_kubernetes(tree: str):
    kv = _validator()
    versions = [MIN_KUBERNETES, kv.latest_version()]
    docs = rendered(tree)
    assert docs
    for doc in docs:
        for version in versions:
            try:
                kv.validate(doc, version, strict=True)
            except kv.ValidationError as exc:
                pytest.fail(f"{tree}: {doc['kind']}/{doc['metadata']['name']} is not valid "
                            f"for Kubernetes {version}: {exc.message} at "
                            f"{'.'.join(str(p) for p in exc.path)}")


def test_the_validator_rejects_what_kubernetes_would():
    """The schemas are strict: a misspelt field is an error, not ignored."""
    kv = _validator()
    doc = find(rendered("base"), "Deployment", "rollout-manager")
    pod_spec(doc)["containers"][0]["readinessProbe"]["grcp"] = {"port": 50200}
    with pytest.raises(kv.ValidationError):
        kv.validate(doc, MIN_KUBERNETES, strict=True)


# ---- docker-compose.yml counterparts ---------------------------------------------------------

def test_every_compose_service_has_a_counterpart():
    assert set(compose_services()) == set(COUNTERPARTS), (
        "a docker-compose.yml service without a Kubernetes counterpart (or a stale entry): "
        "update deploy/k8s and COUNTERPARTS")
    for tree, kind, name in COUNTERPARTS.values():
        find(rendered(tree), kind, name)


@pytest.mark.parametrize("service", sorted(COUNTERPARTS))
def test_counterpart_runs_the_same_program_with_the_same_settings(service: str, tmp_path: Path):
    svc = compose_services()[service]
    tree, kind, name = COUNTERPARTS[service]
    docs = rendered(tree)
    workload = find(docs, kind, name)
    container = pod_spec(workload)["containers"][0]
    if service == "etcd":
        assert container["command"][0] == svc["command"][0] == "etcd"
        assert container["image"] == svc["image"]
        return
    argv = container_argv(container)
    assert Path(argv[0]).name == Path(svc["command"][0]).name, "launched another way"
    if argv[0] == TOOL:  # the same subcommand; its endpoint is per member, its keep per etcd
        assert argv[1] == svc["command"][1]
        expected_params = check_tool_command(svc["command"])
        params = check_tool_command(expanded_argv(container))
        assert params["metrics_port"] == expected_params["metrics_port"]
        return
    program = Path(service_argv(argv)[0]).name
    assert program == Path(service_argv(svc["command"])[0]).name
    assert program in SCRIPTS
    cfg = effective_config(docs, workload, container, tmp_path)
    expected, keys = compose_config(svc)
    for key in sorted(keys - PER_POD_KEYS):
        assert getattr(cfg, key) == getattr(expected, key), (
            f"{service}: {key} is {getattr(expected, key)!r} in docker-compose.yml but "
            f"{getattr(cfg, key)!r} in {kind}/{name} ({tree})")


def test_every_service_program_is_deployed():
    programs = {program for _, _, program in service_containers(rendered("base"))}
    assert programs == set(CONFIGS)
    assert programs <= set(SCRIPTS)


# ---- configs, probes, ports, grace -----------------------------------------------------------

@pytest.mark.parametrize("tree", sorted(TREES))
def test_service_configs_load_and_probes_hit_the_service_ports(tree: str, tmp_path: Path):
    docs = rendered(tree)
    for workload, container, program in service_containers(docs):
        where = f"{tree}: {workload['kind']}/{workload['metadata']['name']}"
        cfg = effective_config(docs, workload, container, tmp_path)  # raises on a bad config
        assert getattr(cfg, "host") == "0.0.0.0", f"{where}: listens on {getattr(cfg, 'host')}"
        ports = declared_ports(container)
        listening = {getattr(cfg, "port"), getattr(cfg, "metrics_port")}
        listening |= {getattr(cfg, k) for k in ("http_port", "data_port") if hasattr(cfg, k)}
        assert 0 not in listening, f"{where}: a port left to chance cannot be probed or exposed"
        assert listening == set(ports.values()), (
            f"{where}: container ports {sorted(set(ports.values()))} but the service listens "
            f"on {sorted(listening)}")
        for probe_name in ("startupProbe", "livenessProbe", "readinessProbe"):
            probe = container.get(probe_name)
            assert probe is not None, f"{where}: no {probe_name}"
            if "grpc" in probe:  # grpc.health.v1 on the service's gRPC port
                assert probe["grpc"]["port"] == getattr(cfg, "port"), f"{where}: {probe_name}"
            else:  # /healthz (alive) or /readyz (ready) on the metrics port (observability.py)
                path = "/readyz" if probe_name == "readinessProbe" else "/healthz"
                assert probe["httpGet"]["path"] == path, f"{where}: {probe_name}"
                assert ports.get(probe["httpGet"]["port"]) == getattr(cfg, "metrics_port"), (
                    f"{where}: {probe_name} port {probe['httpGet']['port']}")
        if not getattr(cfg, "tls_cert"):  # with TLS the kubelet's plaintext gRPC probe cannot
            assert "grpc" in container["readinessProbe"], f"{where}: readiness is gRPC health"
        annotations = workload["spec"]["template"]["metadata"].get("annotations", {})
        assert annotations.get("prometheus.io/port") == str(getattr(cfg, "metrics_port"))


@pytest.mark.parametrize("tree", sorted(TREES))
def test_every_probe_points_at_a_declared_port(tree: str):
    for workload in workloads(rendered(tree)):
        for container in pod_spec(workload)["containers"]:
            ports = declared_ports(container)
            for probe_name in ("startupProbe", "livenessProbe", "readinessProbe"):
                probe = container.get(probe_name)
                if probe is None:
                    continue
                action = probe.get("grpc") or probe.get("httpGet") or probe.get("tcpSocket")
                assert action is not None, f"{workload['metadata']['name']}: {probe_name}"
                assert action["port"] in ports, (
                    f"{tree}: {workload['metadata']['name']} {probe_name} port "
                    f"{action['port']} is not a declared container port")


@pytest.mark.parametrize("tree", sorted(TREES))
def test_grace_periods_cover_drain_and_shutdown(tree: str, tmp_path: Path):
    docs = rendered(tree)
    for workload, container, program in service_containers(docs):
        cfg = effective_config(docs, workload, container, tmp_path)
        grace = pod_spec(workload)["terminationGracePeriodSeconds"]
        where = f"{tree}: {workload['kind']}/{workload['metadata']['name']}"
        assert grace >= shutdown_needs(cfg), (
            f"{where}: terminationGracePeriodSeconds {grace} < {shutdown_needs(cfg)} s of drain "
            "and shutdown grace: SIGKILL would cut the drain short")
        assert grace >= systemd_stop_timeout(program), (
            f"{where}: terminationGracePeriodSeconds {grace} < the systemd unit's "
            f"TimeoutStopSec {systemd_stop_timeout(program)}")


@pytest.mark.parametrize("tree", sorted(TREES))
def test_rlh_variables_name_config_keys(tree: str):
    """The services ignore RLH_ variables that name no config key: a typo would go unnoticed."""
    for workload, container, program in service_containers(rendered(tree)):
        for var in container.get("env", []):
            name = var["name"]
            if not name.startswith("RLH_") or name in TLS_ENV:
                continue
            assert name[4:].lower() in CONFIGS[program].model_fields, (
                f"{tree}: {workload['metadata']['name']} sets {name}, which "
                f"{CONFIGS[program].__name__} does not read")


def test_every_config_map_key_is_used():
    docs = rendered("base")
    [config_map] = [d for d in docs if d["kind"] == "ConfigMap"]
    used = set()
    for workload, container, _ in service_containers(docs):
        path, _ = _split_config_flag(service_argv(container_argv(container))[1:])
        assert path is not None, f"{workload['metadata']['name']} runs without --config"
        mounted_file(docs, workload, container, path)
        used.add(Path(path).name)
    assert used == set(config_map["data"])


@pytest.mark.parametrize("tree", sorted(TREES))
def test_services_and_their_pods_agree(tree: str):
    docs = rendered(tree)
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    for service in services.values():
        selector = service["spec"]["selector"]
        matched = [w for w in workloads(docs) if selector.items()
                   <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert matched, f"{tree}: Service {service['metadata']['name']} selects no pods"
        for port in service["spec"]["ports"]:
            for workload in matched:
                declared = {p for c in pod_spec(workload)["containers"]
                            for p in declared_ports(c)}
                assert port["targetPort"] in declared, (
                    f"{tree}: Service {service['metadata']['name']} port {port['name']} -> "
                    f"{port['targetPort']}, not a port of {workload['metadata']['name']}")
    for workload in workloads(docs):
        selector = workload["spec"]["selector"]["matchLabels"]
        assert selector.items() <= workload["spec"]["template"]["metadata"]["labels"].items()
        if workload["kind"] == "StatefulSet":
            governing = services[workload["spec"]["serviceName"]]
            assert governing["spec"].get("clusterIP") == "None", "needs a headless Service"


def test_etcd_members_and_the_services_agree():
    docs = rendered("base")
    etcd = find(docs, "StatefulSet", "etcd")
    args = pod_spec(etcd)["containers"][0]["args"]
    [cluster] = [a.split("=", 1)[1] for a in args if a.startswith("--initial-cluster=")]
    peer_service = etcd["spec"]["serviceName"]
    members = [m.split("=", 1) for m in cluster.split(",")]
    assert [name for name, _ in members] == [f"etcd-{i}" for i in range(etcd["spec"]["replicas"])]
    for name, url in members:
        assert url == f"http://{name}.{peer_service}:2380"
    assert find(docs, "Service", peer_service)["spec"]["publishNotReadyAddresses"] is True
    assert etcd["spec"]["podManagementPolicy"] == "Parallel"
    pdb = find(docs, "PodDisruptionBudget", "etcd")
    assert pdb["spec"]["minAvailable"] == etcd["spec"]["replicas"] // 2 + 1  # the quorum
    client = find(docs, "Service", "etcd")
    for workload, container, program in service_containers(docs):
        path, _ = _split_config_flag(service_argv(container_argv(container))[1:])
        text = mounted_file(docs, workload, container, path or "")
        host, _, port = tomllib.loads(text)["etcd"].partition(":")
        assert host == client["metadata"]["name"]
        assert int(port) in {p["port"] for p in client["spec"]["ports"]}


def expanded_argv(container: dict) -> list[str]:
    """The argv as Kubernetes runs it: $(VAR) replaced by the container's own env values."""
    env = {v["name"]: v["value"] for v in container.get("env", []) if "value" in v}
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a)
            for a in container_argv(container)]


def retention_s(etcd_args: list[str]) -> float:
    """etcd's own periodic compaction retention (--auto-compaction-retention=5m, 1h), seconds."""
    [value] = [a.split("=", 1)[1] for a in etcd_args
               if a.startswith("--auto-compaction-retention=")]
    return float(value[:-1]) * {"s": 1, "m": 60, "h": 3600}[value[-1]]


@pytest.mark.parametrize("tree", sorted(TREES))
def test_one_etcd_maintainer_per_etcd_member(tree: str):
    """A defrag acts on the member it reaches: each member gets a maintainer of its own (one
    replica), with a command the CLI takes, probes on its metrics port, and history kept as long
    as etcd's own compactor keeps it."""
    docs = rendered(tree)
    etcd = find(docs, "StatefulSet", "etcd")
    scheme = "https" if tree == "tls" else "http"
    members = {f"{scheme}://etcd-{i}.{etcd['spec']['serviceName']}:2379"
               for i in range(etcd["spec"]["replicas"])}
    reached = []
    for workload in workloads(docs):
        [container, *_] = pod_spec(workload)["containers"]
        if container_argv(container)[:2] != [TOOL, "etcd-maintain"]:
            continue
        name = workload["metadata"]["name"]
        assert workload["kind"] == "Deployment" and workload["spec"]["replicas"] == 1, name
        params = check_tool_command(expanded_argv(container))
        reached.append(params["etcd"])
        assert params["keep_s"] == retention_s(pod_spec(etcd)["containers"][0]["args"]), name
        ports = declared_ports(container)
        for probe in ("startupProbe", "livenessProbe"):
            get = container[probe]["httpGet"]
            assert get["path"] == "/healthz" and ports[get["port"]] == params["metrics_port"]
            assert get.get("scheme", "HTTP") == scheme.upper(), f"{name}: {probe}"
        annotations = workload["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == str(params["metrics_port"])
        assert "rlharvest.io/service" not in workload["metadata"].get("labels", {}), (
            f"{name}: a service label would give it the services' certificate (tls.yaml)")
    assert sorted(reached) == sorted(members)


def test_compose_etcd_maintainer_keeps_what_compose_etcd_keeps():
    services = compose_services()
    params = check_tool_command(services["etcd-maintenance"]["command"])
    assert params["keep_s"] == retention_s(services["etcd"]["command"])


def test_tls_overlay_gives_etcd_maintainers_an_admin_certificate():
    """Once etcd's auth is on, etcd refuses a service role's defrag: the maintainers hold the
    admin's Secret, never the services' one."""
    docs = rendered("tls")
    maintainers = [w for w in workloads(docs)
                   if w["metadata"]["labels"]["app.kubernetes.io/name"] == "etcd-maintenance"]
    assert maintainers
    for workload in maintainers:
        [container] = pod_spec(workload)["containers"]
        volumes = {v["name"]: v for v in pod_spec(workload)["volumes"]}
        assert {v["secret"]["secretName"] for v in volumes.values()} == {ADMIN_SECRET}
        [mount] = [m for m in container["volumeMounts"] if m["mountPath"] == ADMIN_DIR]
        assert mount.get("readOnly") is True
        env = {v["name"]: v.get("value") for v in container["env"]}
        for var, file in TLS_ENV.items():
            assert env.get(var) == f"{ADMIN_DIR}/{file}", workload["metadata"]["name"]
    readme = (K8S / "README.md").read_text()
    assert ADMIN_SECRET in readme and "etcd-maintenance" in readme


# ---- overlays --------------------------------------------------------------------------------

def test_gpu_overlay_gives_the_gpu_roles_their_gpus():
    docs = rendered("gpu")
    for workload, container, program in service_containers(docs):
        name = workload["metadata"]["name"]
        gpus = container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
        assert gpus == GPU_ROLES.get(name), f"{name}: nvidia.com/gpu {gpus}"
        if name in GPU_ROLES:
            tolerations = pod_spec(workload)["tolerations"]
            assert any(t["key"] == "nvidia.com/gpu" for t in tolerations if "key" in t)
            assert container["image"].startswith("rlharvest-gpu")
    trainer = pod_spec(find(docs, "StatefulSet", "trainer"))["containers"][0]
    launch = torchrun_parser().parse_args(trainer["command"][1:] + trainer["args"])
    assert int(launch.nproc_per_node) == GPU_ROLES["trainer"]
    assert launch.max_restarts > 0
    # the spot workers still only go to spot nodes, and still tolerate their taints
    base_spot = pod_spec(find(rendered("base"), "Deployment", "rollout-worker-spot"))
    gpu_spot = pod_spec(find(docs, "Deployment", "rollout-worker-spot"))
    assert gpu_spot["affinity"] == base_spot["affinity"]
    assert all(t in gpu_spot["tolerations"] for t in base_spot["tolerations"])
    for workload, container, _ in service_containers(rendered("base")):
        assert "nvidia.com/gpu" not in str(container.get("resources")), "GPUs are the overlay's"


def test_gpu_overlay_runs_the_gpu_roles_on_their_gpus(tmp_path: Path):
    """A GPU limit alone leaves the engines and the trainer on the CPU: each GPU role's config
    names the device (engines in bf16, the serving dtype)."""
    docs = rendered("gpu")
    seen = set()
    for workload, container, _ in service_containers(docs):
        name = workload["metadata"]["name"]
        if name not in GPU_ROLES:
            continue
        cfg = effective_config(docs, workload, container, tmp_path)
        assert getattr(cfg, "device") == "cuda", f"{name} runs on {getattr(cfg, 'device')}"
        if hasattr(cfg, "dtype"):
            assert getattr(cfg, "dtype") == "bfloat16", name
        if hasattr(cfg, "publish_dtype"):  # the trainer publishes what the engines serve
            assert getattr(cfg, "publish_dtype") == "bfloat16", name
        seen.add(name)
    assert seen == set(GPU_ROLES)
    for workload, container, _ in service_containers(rendered("base")):
        cfg = effective_config(rendered("base"), workload, container, tmp_path)
        assert getattr(cfg, "device", "cpu") == "cpu", "GPUs are the overlay's"


def test_tls_overlay_mounts_the_certificates_in_every_service():
    docs = rendered("tls")
    for workload, container, _ in service_containers(docs):
        name = workload["metadata"]["name"]
        volumes = {v["name"]: v for v in pod_spec(workload)["volumes"]}
        [mount] = [m for m in container["volumeMounts"] if m["mountPath"] == TLS_DIR]
        assert mount.get("readOnly") is True
        assert volumes[mount["name"]]["secret"]["secretName"] == TLS_SECRET, name
        env = {v["name"]: v.get("value") for v in container["env"]}
        for var, file in TLS_ENV.items():
            assert env.get(var) == f"{TLS_DIR}/{file}", f"{name}: {var}"
    for workload, container, _ in service_containers(rendered("base")):
        assert not set(TLS_ENV) & {v["name"] for v in container["env"]}


def test_tls_overlay_probes_health_over_https_without_a_client_certificate():
    """Alive is /healthz; ready is /readyz, the gRPC health's SERVING (a standby leader or a
    draining member is alive but not ready): the paths open without a client certificate."""
    for workload, container, _ in service_containers(rendered("tls")):
        name = workload["metadata"]["name"]
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            get = container[probe].get("httpGet")
            assert get is not None and get["scheme"] == "HTTPS", f"{name}: {probe}"
            want = "/readyz" if probe == "readinessProbe" else "/healthz"
            assert get["path"] == want, f"{name}: {probe}"


def test_spot_workers_only_run_on_spot_capacity():
    docs = rendered("base")
    spot = find(docs, "Deployment", "rollout-worker-spot")
    container = pod_spec(spot)["containers"][0]
    argv = service_argv(container_argv(container))
    assert parse_flags(WorkerConfig, _split_config_flag(argv[1:])[1])["kind"] == "spot"
    terms = pod_spec(spot)["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms and all(t["matchExpressions"] for t in terms)
    dedicated = find(docs, "Deployment", "rollout-worker")
    assert "affinity" not in pod_spec(dedicated) and "tolerations" not in pod_spec(dedicated)


def test_readme_documents_the_overlays():
    readme = (K8S / "README.md").read_text()
    for needle in ("overlays/gpu", "overlays/tls", TLS_SECRET, *TLS_ENV, "urn:rlharvest:role:"):
        assert needle in readme, needle
    assert re.search(r"kubectl apply -k", readme)


def test_tls_overlay_puts_etcd_under_tls_to_clients_and_peers_and_services_dial_https():
    """etcd serves its whole API on the peer port: under the TLS overlay it takes certificates
    there, and of the name etcd-peer only; its clients need one of the CA; services dial it
    over https."""
    docs = rendered("tls")
    args = pod_spec(find(docs, "StatefulSet", "etcd"))["containers"][0]["args"]
    flags = dict(a.removeprefix("--").partition("=")[::2] for a in args)
    for url in ("listen-client-urls", "listen-peer-urls", "initial-advertise-peer-urls"):
        assert flags[url].startswith("https://"), url
    assert all(m.split("=", 1)[1].startswith("https://")
               for m in flags["initial-cluster"].split(","))
    assert {"client-cert-auth", "peer-client-cert-auth"} <= set(flags)
    assert flags["peer-cert-allowed-cn"] == "etcd-peer"
    assert flags["peer-trusted-ca-file"] != flags["trusted-ca-file"]  # a CA of the peers' own
    for workload, container, _ in service_containers(docs):
        env = {v["name"]: v.get("value") for v in container["env"]}
        assert env.get("RLH_ETCD") == "https://etcd:2379", workload["metadata"]["name"]


def test_only_etcd_members_may_reach_etcds_peer_port():
    policy = find(rendered("base"), "NetworkPolicy", "etcd-peer")
    etcd_pods = {"app.kubernetes.io/name": "etcd"}
    assert policy["spec"]["podSelector"]["matchLabels"] == etcd_pods
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    for rule in policy["spec"]["ingress"]:
        ports = {p["port"] for p in rule["ports"]}
        if 2380 in ports:
            assert [f["podSelector"]["matchLabels"] for f in rule["from"]] == [etcd_pods]
        else:
            assert "from" not in rule and ports <= {2379, 2381}
