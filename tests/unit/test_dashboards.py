"""The operator's view, checked without Grafana or Prometheus running: the Grafana dashboards in
deploy/grafana/dashboards/, the provisioning in deploy/grafana/provisioning/, the Prometheus
config and alert rules in deploy/prometheus/ and how docker-compose.yml includes them.

Every metric a dashboard panel, a dashboard variable or an alert rule queries must be one the
services export, under the name Prometheus stores it by. The exported names come from the
services' own code, in two ways:

- **The registry.** Every module under ``services/`` and ``common/`` that constructs a
  ``prometheus_client`` metric is imported in a fresh Python process, which then reads
  ``prometheus_client.REGISTRY`` — the registry ``start_http`` serves on every service's
  ``/metrics``. Its metric families give the exact exposed series: a counter family ``x`` is
  scraped as ``x_total`` (and ``x_created``), a histogram ``h`` as ``h_bucket``, ``h_sum``,
  ``h_count``; the process and platform collectors (``process_resident_memory_bytes``, ...) are
  there too. A fresh process, not this one, so that metrics other tests register are not
  counted, and so the probe can assert that importing these modules starts nothing (no thread, no
  child process, no event loop): they are imported by every service and test.
- **The source, as a fallback.** A metric constructed inside a function, or into a per-instance
  ``CollectorRegistry``, is not in ``REGISTRY`` after an import. None exists today
  (``CollectorRegistry`` only appears as ``start_http``'s parameter type, and every service
  passes the default), and instantiating services to find them would mean etcd, gRPC and
  engines; so metric constructors found by a regex over the source (``Counter("name", ...``)
  are added with the same suffix rules. A metric of that kind still counts as exported; one
  that exists nowhere fails the test.

PromQL is not parsed fully: a small tokenizer drops string literals (label values, template
variables such as ``$member``), label matchers, range and subquery brackets and ``by``/``on``
label lists, then takes every remaining identifier that is not called (functions and
aggregations are followed by ``(``) and is not a keyword. Where ``promtool`` is installed, every
expression is also checked for PromQL syntax by ``promtool check rules``.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DASHBOARD_DIR = ROOT / "deploy" / "grafana" / "dashboards"
DASHBOARDS = sorted(DASHBOARD_DIR.glob("*.json"))
PROVISIONING = ROOT / "deploy" / "grafana" / "provisioning"
PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# The one dashboard of each service, and the overview.
EXPECTED_BOARDS = {"overview", "rollout-worker", "rollout-manager", "transfer-agent", "trainer",
                   "coexecutor", "placement-scheduler"}
# Series Prometheus adds to every target itself.
SCRAPE_SERIES = {"up", "scrape_duration_seconds", "scrape_samples_scraped",
                 "scrape_samples_post_metric_relabeling", "scrape_series_added"}


# ---- the metrics the services export -----------------------------------------------------------

_CONSTRUCTOR = re.compile(
    r"\b(Counter|Gauge|Histogram|Summary|Info|Enum)\(\s*[\"']([A-Za-z_:][A-Za-z0-9_:]*)[\"']")
_TYPES = {"Counter": "counter", "Gauge": "gauge", "Histogram": "histogram",
          "Summary": "summary", "Info": "info", "Enum": "stateset"}

# Run in a fresh interpreter: import the modules named on the command line, check that nothing
# started, print the default registry's families as {name: type}.
_PROBE = """
import asyncio, importlib, json, multiprocessing, sys, threading
for module in sys.argv[1:]:
    importlib.import_module(module)
assert threading.active_count() == 1, [t.name for t in threading.enumerate()]
assert not multiprocessing.active_children(), multiprocessing.active_children()
try:
    asyncio.get_running_loop()
except RuntimeError:
    pass
else:
    raise AssertionError("an event loop is running after the imports")
from prometheus_client import REGISTRY
print(json.dumps({family.name: family.type for family in REGISTRY.collect()}))
"""


def _metric_sources() -> dict[str, list[tuple[str, str]]]:
    """Module -> (type, name) of every prometheus_client metric constructed in its source."""
    found: dict[str, list[tuple[str, str]]] = {}
    for top in ("services", "common"):
        for path in sorted((ROOT / "rlharvest" / top).rglob("*.py")):
            if "pb" in path.relative_to(ROOT).parts:
                continue  # generated protobuf code
            text = path.read_text()
            if "prometheus_client" not in text:
                continue  # a collections.Counter is not a metric
            metrics = [(_TYPES[kind], name) for kind, name in _CONSTRUCTOR.findall(text)]
            if metrics:
                module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
                found[module] = metrics
    return found


def _family_name(kind: str, name: str) -> str:
    """As prometheus_client names the family: a counter's ``_total`` is the sample's suffix."""
    return name[: -len("_total")] if kind == "counter" and name.endswith("_total") else name


def _series(kind: str, family: str) -> set[str]:
    """The series names a family is scraped as."""
    if kind == "counter":
        return {f"{family}_total", f"{family}_created"}
    if kind in ("histogram", "gaugehistogram"):
        return {f"{family}_bucket", f"{family}_sum", f"{family}_count", f"{family}_created",
                f"{family}_gsum", f"{family}_gcount"}
    if kind == "summary":
        return {family, f"{family}_sum", f"{family}_count", f"{family}_created"}
    if kind == "info":
        return {f"{family}_info"}
    return {family}


@functools.lru_cache(maxsize=None)
def exported_families() -> dict[str, str]:
    """Family name -> type: the default registry after importing every metrics module, plus
    the source fallback (see the module docstring)."""
    sources = _metric_sources()
    probe = subprocess.run([sys.executable, "-c", _PROBE, *sorted(sources)], cwd=ROOT,
                           capture_output=True, text=True, timeout=240)
    assert probe.returncode == 0, f"importing the metrics modules failed:\n{probe.stderr}"
    families: dict[str, str] = json.loads(probe.stdout.strip().splitlines()[-1])
    for metrics in sources.values():
        for kind, name in metrics:
            families.setdefault(_family_name(kind, name), kind)
    return families


@functools.lru_cache(maxsize=None)
def exported_series() -> frozenset[str]:
    return frozenset(itertools.chain.from_iterable(
        _series(kind, family) for family, kind in exported_families().items()))


@functools.lru_cache(maxsize=None)
def rate_series() -> frozenset[str]:
    """Series rate() and increase() make sense of: counters and histograms' parts."""
    return frozenset(itertools.chain.from_iterable(
        _series(kind, family) for family, kind in exported_families().items()
        if kind in ("counter", "histogram", "summary")))


# ---- PromQL ------------------------------------------------------------------------------------

_KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool", "and",
    "or", "unless", "atan2", "inf", "nan", "Inf", "NaN",
    # aggregations, which may stand before their `by (...)` instead of their `(`
    "sum", "avg", "min", "max", "count", "stddev", "stdvar", "topk", "bottomk", "quantile",
    "count_values", "group", "limitk", "limit_ratio",
}
_STRING = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`')
_NAME_MATCHER = re.compile(r'__name__\s*=\s*"([A-Za-z_:][A-Za-z0-9_:]*)"')
_LABEL_LIST = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENTIFIER = re.compile(r"(?<![\w$.:])([A-Za-z_:][A-Za-z0-9_:]*)")
_RATE_OF = re.compile(r"\b(?:rate|irate|increase)\(\s*([A-Za-z_:][A-Za-z0-9_:]*)")


def _strip(expr: str) -> str:
    expr = _STRING.sub('""', expr)
    expr = re.sub(r"\{[^}]*\}", "{}", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "[]", expr)  # ranges, subqueries ($__rate_interval)
    return _LABEL_LIST.sub(r"\1", expr)


def metric_names(expr: str) -> set[str]:
    """Every metric name a PromQL expression selects."""
    names = set(_NAME_MATCHER.findall(expr))
    stripped = _strip(expr)
    for match in _IDENTIFIER.finditer(stripped):
        name = match.group(1)
        if stripped[match.end():].lstrip().startswith("("):
            continue  # a function or an aggregation
        if name not in _KEYWORDS:
            names.add(name)
    return names


def variable_query_names(query: str) -> set[str]:
    """Grafana's ``label_values(selector, label)``: the selector's metric names."""
    call = re.fullmatch(r"\s*label_values\((.*),\s*[A-Za-z_]\w*\s*\)\s*", query)
    if call:
        return metric_names(call.group(1))
    if re.fullmatch(r"\s*label_values\(\s*[A-Za-z_]\w*\s*\)\s*", query):
        return set()
    return metric_names(re.sub(r"^\s*query_result\((.*)\)\s*$", r"\1", query))


def test_the_tokenizer_finds_selected_metrics_and_nothing_else():
    assert metric_names(
        'histogram_quantile(0.99, sum by (le, member) (rate(rlh_a_bucket{service="x", '
        'member=~"$member"}[$__rate_interval])))') == {"rlh_a_bucket"}
    assert metric_names("sum(rate(rlh_b_total[5m])) / on(job) group_left(instance) rlh_c "
                        "> bool 1e3") == {"rlh_b_total", "rlh_c"}
    assert metric_names('{__name__="rlh_d"} offset 5m or max without (x) (rlh_e)') == {
        "rlh_d", "rlh_e"}
    assert metric_names('label_replace(up, "dst", "$1", "src", "(.*)") * 60') == {"up"}
    assert variable_query_names('label_values(up{service="trainer"}, member)') == {"up"}


# ---- the dashboards ----------------------------------------------------------------------------

def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def _panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, rows' nested (collapsed) panels included."""
    out = []
    for panel in board["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def _queries(board: dict[str, Any]) -> list[tuple[str, set[str], str]]:
    """(where, metric names, expression) of every panel target and query variable."""
    out = []
    for panel in _panels(board):
        for target in panel.get("targets", []):
            out.append((f"panel {panel['title']!r} {target['refId']}",
                        metric_names(target["expr"]), target["expr"]))
    for var in board["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            out.append((f"variable ${var['name']}", variable_query_names(query), query))
    return out


def _overlap(a: dict[str, int], b: dict[str, int]) -> bool:
    return (a["x"] < b["x"] + b["w"] and b["x"] < a["x"] + a["w"]
            and a["y"] < b["y"] + b["h"] and b["y"] < a["y"] + a["h"])


def test_there_is_an_overview_and_one_dashboard_per_service():
    assert {p.stem for p in DASHBOARDS} == EXPECTED_BOARDS
    uids = [_load(p)["uid"] for p in DASHBOARDS]
    assert len(uids) == len(set(uids)), uids
    titles = [_load(p)["title"] for p in DASHBOARDS]
    assert len(titles) == len(set(titles)), titles


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_dashboard_is_well_formed(path: Path):
    board = _load(path)
    assert board["title"] and board["uid"] and "rlharvest" in board["tags"]
    assert board.get("id") is None, "a provisioned dashboard must not pin a database id"
    variables = {v["name"]: v for v in board["templating"]["list"]}
    ds = variables["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    assert ds["current"]["value"] == _provisioned_datasource()["uid"]
    for var in variables.values():
        if var["type"] == "query":
            assert var["datasource"] == DATASOURCE, var["name"]
    panels = _panels(board)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), f"duplicate panel ids in {path.name}"
    graphs = [p for p in panels if p["type"] != "row"]
    assert len(graphs) >= 6, "a dashboard needs more than a handful of panels"
    for panel in graphs:
        title = panel.get("title")
        assert title, f"panel {panel['id']} of {path.name} has no title"
        assert panel["datasource"] == DATASOURCE, title
        targets = panel.get("targets")
        assert targets, f"panel {title!r} has no targets"
        ref_ids = [t["refId"] for t in targets]
        assert len(ref_ids) == len(set(ref_ids)), title
        for target in targets:
            assert target["datasource"] == DATASOURCE, title
            assert target["expr"].strip(), title
        pos = panel["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24 and pos["h"] > 0, title
    for a, b in itertools.combinations([p for p in panels if "gridPos" in p], 2):
        assert not _overlap(a["gridPos"], b["gridPos"]), (a["title"], b["title"])
    # Every $variable a query uses is defined (Grafana's own are $__...).
    for where, _, expr in _queries(board):
        for name in re.findall(r"\$\{?([A-Za-z_]\w*)", expr):
            assert name.startswith("__") or name in variables, f"{where}: ${name}"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_dashboard_queries_only_metrics_the_services_export(path: Path):
    exported = exported_series() | SCRAPE_SERIES
    unknown = [(where, sorted(names - exported)) for where, names, _ in _queries(_load(path))
               if names - exported]
    assert not unknown, f"{path.name} queries metrics no service exports: {unknown}"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_dashboard_rates_counters_and_quantiles_histograms(path: Path):
    for where, names, expr in _queries(_load(path)):
        for name in _RATE_OF.findall(_strip(expr)):
            assert name in rate_series(), f"{path.name} {where}: rate/increase of {name}"
        if "histogram_quantile" in expr:
            assert any(n.endswith("_bucket") for n in names), f"{path.name} {where}: {expr}"


def test_the_exported_set_is_the_services_metrics():
    """The probe did import the services' metrics (not an empty registry)."""
    families = exported_families()
    assert families["rlh_trainer_steps"] == "counter"
    assert families["rlh_worker_step_seconds"] == "histogram"
    assert families["rlh_manager_tokens_regenerated"] == "gauge"
    assert "rlh_trainer_steps_total" in exported_series()
    assert "rlh_trainer_steps" not in exported_series()  # a counter is scraped with _total
    assert sum(name.startswith("rlh_") for name in families) >= 50


# ---- provisioning, Prometheus, compose ---------------------------------------------------------

def _yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def _included_services() -> dict[str, tuple[Path, dict[str, Any]]]:
    """Services of the files docker-compose.yml includes: name -> (its file, its definition)."""
    out = {}
    for entry in _yaml(COMPOSE).get("include", []):
        paths = entry["path"] if isinstance(entry, dict) else entry
        for rel in [paths] if isinstance(paths, str) else paths:
            path = ROOT / rel
            for name, svc in _yaml(path)["services"].items():
                out[name] = (path, svc)
    return out


def _mounts(service: str) -> dict[str, Path]:
    """Container path -> host path of a included service's bind mounts."""
    path, svc = _included_services()[service]
    out = {}
    for volume in svc.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("."):
            out[target] = (path.parent / source).resolve()
    return out


def _provisioned_datasource() -> dict[str, Any]:
    [source] = _yaml(PROVISIONING / "datasources" / "prometheus.yml")["datasources"]
    return source


def test_compose_includes_prometheus_and_grafana_with_their_files():
    services = _included_services()
    assert not set(services) & set(_yaml(COMPOSE)["services"]), "a service defined twice"
    images = {name: svc["image"].split(":")[0] for name, (_, svc) in services.items()}
    assert images == {"prometheus": "prom/prometheus", "grafana": "grafana/grafana"}
    for name, (_, svc) in services.items():
        assert svc["healthcheck"]["test"], name
        for target, source in _mounts(name).items():
            assert source.exists(), f"{name} mounts {source}, which is missing"
    prometheus = _mounts("prometheus")
    assert prometheus["/etc/prometheus/prometheus.yml"] == PROMETHEUS_CONFIG
    assert prometheus["/etc/prometheus/alerts.yml"] == ALERTS
    assert "--config.file=/etc/prometheus/prometheus.yml" in services["prometheus"][1]["command"]
    assert _mounts("grafana")["/etc/grafana/provisioning"] == PROVISIONING


def test_grafana_provisions_the_prometheus_datasource_and_the_dashboards():
    source = _provisioned_datasource()
    assert source["type"] == "prometheus" and source["uid"] == "prometheus"
    assert source["url"] == "http://prometheus:9090"  # the compose service, its default port
    [provider] = _yaml(PROVISIONING / "dashboards" / "rlharvest.yml")["providers"]
    assert provider["type"] == "file"
    assert _mounts("grafana")[provider["options"]["path"]] == DASHBOARD_DIR
    home = _included_services()["grafana"][1]["environment"]
    home_path = Path(home["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"])
    assert (DASHBOARD_DIR / home_path.relative_to(provider["options"]["path"])).is_file()


def _metrics_endpoint(name: str, argv: list[str],
                      env: dict[str, str]) -> tuple[str, dict[str, str]] | None:
    """A compose service's scrape target and the labels `rlharvest up --prometheus` would give
    it (service: the etcd member kind, member: its id), or None without a metrics port. The
    etcd maintainer is no member: labelled by the etcd host it keeps small (--etcd, RLH_ETCD)."""
    if "--metrics-port" not in argv:
        return None
    port = argv[argv.index("--metrics-port") + 1]
    if argv[:2] == ["rlharvest", "etcd-maintain"]:
        etcd = argv[argv.index("--etcd") + 1] if "--etcd" in argv else env["RLH_ETCD"]
        host = etcd.split("://")[-1].rsplit(":", 1)[0]
        return f"{name}:{port}", {"service": "etcd_maintenance", "member": host}
    if "-m" in argv:  # torchrun -m rlharvest.services.<kind>.main
        kind = argv[argv.index("-m") + 1].split(".")[-2]
    else:
        kind = Path(argv[0]).name.removeprefix("rlharvest-").replace("-", "_")
    [member] = [argv[i + 1] for i, arg in enumerate(argv) if re.fullmatch(r"--\w+-id", arg)]
    return f"{name}:{port}", {"service": kind, "member": member}


def test_prometheus_scrapes_every_compose_service_with_a_metrics_port():
    scraped: dict[str, dict[str, str]] = {}
    for job in _yaml(PROMETHEUS_CONFIG)["scrape_configs"]:
        for group in job["static_configs"]:
            for target in group["targets"]:
                scraped[target] = group.get("labels", {})
    expected = {}
    for name, svc in _yaml(COMPOSE)["services"].items():
        endpoint = _metrics_endpoint(name, [str(a) for a in svc.get("command", [])],
                                     {k: str(v) for k, v in (svc.get("environment") or {}).items()})
        if endpoint is not None:
            expected[endpoint[0]] = endpoint[1]
    assert len(expected) >= 8
    assert scraped == expected


def test_alert_rules_query_only_exported_metrics():
    exported = exported_series() | SCRAPE_SERIES
    rules = [rule for group in _yaml(ALERTS)["groups"] for rule in group["rules"]]
    assert {"RlharvestTokensRegenerated", "RlharvestWorkerLost", "RlharvestTrainerStepsFailed",
            "RlharvestServingSloAttainmentLow", "RlharvestRewardFailures"} <= {
        rule["alert"] for rule in rules}
    for rule in rules:
        assert metric_names(rule["expr"]) <= exported, rule["alert"]
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_accepts_the_config_the_rules_and_every_dashboard_expression(tmp_path):
    check = subprocess.run(["promtool", "check", "config", str(PROMETHEUS_CONFIG)],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    rules: list[dict[str, str]] = []
    for path in DASHBOARDS:
        for where, _, expr in _queries(_load(path)):
            if where.startswith("variable"):
                continue  # label_values() is Grafana's, not PromQL
            expr = expr.replace("$__rate_interval", "1m").replace("$__interval", "1m")
            expr = re.sub(r"\$\{?\w+\}?", ".*", expr)
            rules.append({"record": f"rlh:{path.stem.replace('-', '_')}:{len(rules)}",
                          "expr": expr})
    rules_file = tmp_path / "dashboards.rules.yml"
    rules_file.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    check = subprocess.run(["promtool", "check", "rules", str(rules_file)],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr


# What the issue asks the overview to show, each as (a metric its panels must query, the label a
# per-member series must be split by, or None).
OVERVIEW_MUST_SHOW = {
    "jobs": ("rlh_placement_jobs", None),
    "steps": ("rlh_trainer_step", None),
    "reward": ("rlh_trainer_mean_reward", None),
    "tokens trained per second": ("rlh_trainer_tokens_trained_total", None),
    "migrations": ("rlh_manager_migrations_total", None),
    "tokens regenerated": ("rlh_manager_tokens_regenerated", None),
    "weight versions per worker": ("rlh_worker_weight_version", "{{member}}"),
    "serving SLO attainment": ("rlh_coexec_serving_slo_total", None),
}


@pytest.mark.parametrize("what", sorted(OVERVIEW_MUST_SHOW))
def test_the_overview_shows_what_an_operator_asks_first(what: str):
    metric, legend = OVERVIEW_MUST_SHOW[what]
    targets = [t for panel in _panels(_load(DASHBOARD_DIR / "overview.json"))
               for t in panel.get("targets", []) if metric in metric_names(t["expr"])]
    assert targets, f"no overview panel queries {metric} ({what})"
    if legend is not None:
        assert any(t.get("legendFormat") == legend for t in targets), targets
