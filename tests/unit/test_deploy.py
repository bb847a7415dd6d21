"""docker-compose.yml, the systemd units and the example configs are read and checked here: no
Docker engine or systemd runs on the test machines, so this is what keeps them correct."""

from __future__ import annotations

import configparser
import os
import shlex
import shutil
import subprocess
try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml

from torch.distributed.run import get_args_parser as torchrun_parser

from rlharvest.cli import main as cli_main
from rlharvest.common.cli import parse_flags
from rlharvest.common.config import ServiceConfig, load_config
from rlharvest.services.coexecutor.config import CoexecutorConfig
from rlharvest.services.rollout_manager.config import ManagerConfig
from rlharvest.services.placement_scheduler.config import PlacementConfig
from rlharvest.services.rollout_worker.config import WorkerConfig
from rlharvest.services.trainer.config import TrainerConfig
from rlharvest.services.transfer_agent.config import AgentConfig

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
CONFIGS: dict[str, type[ServiceConfig]] = {
    "rlharvest-transfer-agent": AgentConfig, "rlharvest-rollout-worker": WorkerConfig,
    "rlharvest-rollout-manager": ManagerConfig}
CONFIGS["rlharvest-placement-scheduler"] = PlacementConfig
CONFIGS["rlharvest-trainer"] = TrainerConfig
CONFIGS["rlharvest-coexecutor"] = CoexecutorConfig


MODULES = {"rlharvest.services.trainer.main": "rlharvest-trainer"}
# Console scripts that are tools an operator runs, not long-lived services to deploy.
TOOLS = {"rlharvest", "rlharvest-loadgen"}


def _service_argv(argv: list[str]) -> list[str]:
    """A service's own argv; a ``torchrun`` line (a multi-rank trainer) is parsed by torchrun's
    own parser and must launch a service module as a module."""
    if Path(argv[0]).name != "torchrun":
        return argv
    launch = torchrun_parser().parse_args(argv[1:])
    assert launch.module and launch.training_script in MODULES, argv
    assert launch.max_restarts > 0, "a multi-rank trainer must let torchrun restart its group"
    return [MODULES[launch.training_script], *launch.training_script_args]


def _config_of(argv: list[str]):
    argv = _service_argv(argv)
    program = Path(argv[0]).name
    return CONFIGS[program](**parse_flags(CONFIGS[program], argv[1:]))


def test_compose_stack_is_one_job_whose_workers_follow_the_trainer():
    """Without --agent-pull and the trainer's job, workers would never load version 1 and the
    trainer's second step would wait for a worker forever."""
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    by_program: dict[str, list] = {}
    for name, svc in services.items():
        # a profile is an alternative; a tool (the etcd maintainer) is no member of the job
        if name != "etcd" and not svc.get("profiles") and svc["command"][0] not in TOOLS:
            by_program.setdefault(svc["command"][0], []).append(_config_of(svc["command"]))
    [trainer] = by_program["rlharvest-trainer"]
    managers = by_program["rlharvest-rollout-manager"]
    workers = by_program["rlharvest-rollout-worker"]
    # The job's manager and its hot standby: one job, two ids (the election's candidates).
    assert [m.job for m in managers] == [trainer.job] * 2
    assert len({m.manager_id for m in managers}) == 2
    assert len(workers) >= 3 and any(w.kind == "spot" for w in workers)
    for w in workers:
        assert w.agent_pull and w.job == trainer.job
        assert w.model == trainer.model and w.model_seed == trainer.model_seed
    assert by_program["rlharvest-transfer-agent"]


def _check_command(argv: list[str]) -> str | None:
    argv = _service_argv(argv)
    program = Path(argv[0]).name
    assert program in SCRIPTS, f"{program} is not a console script in pyproject.toml"
    args = argv[1:]
    config_file = None
    if "--config" in args:
        i = args.index("--config")
        config_file = args[i + 1]
        args = args[:i] + args[i + 2:]
    flags = parse_flags(CONFIGS[program], args)  # raises on an unknown flag
    CONFIGS[program](**flags)  # raises on a bad value
    return config_file


def test_compose_services_run_real_commands_with_valid_flags():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert "etcd" in services
    for name, svc in services.items():
        if name == "etcd":
            continue
        assert svc["depends_on"]["etcd"]["condition"] == "service_healthy"
        env = svc["environment"]
        assert env["RLH_ETCD"] == "etcd:2379", name
        if svc["command"][0] in TOOLS:
            check_tool_command(svc["command"])
        else:
            _check_command(svc["command"])
        assert (ROOT / svc["build"]["dockerfile"]).is_file()


def test_every_console_script_has_a_compose_service_and_a_systemd_unit():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    programs = {_service_argv(svc["command"])[0] for n, svc in compose["services"].items()
                if n != "etcd"}
    units = {p.stem for p in (ROOT / "deploy" / "systemd").glob("*.service")}
    for script in SCRIPTS:
        if script in TOOLS:
            continue
        assert script in programs, f"{script} has no docker-compose.yml entry"
        assert script in units, f"{script} has no deploy/systemd unit"


def _read_unit(unit: Path) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=True, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keys keep their case
    parser.read(unit)
    return parser


# What the CLI parser raises on a bad flag or value (typer's vendored click has no public name).
USAGE_ERROR = typer.BadParameter.__mro__[1]
assert USAGE_ERROR.__name__ == "UsageError"

# Units that run a tool's subcommand (`rlharvest etcd-maintain`), not a service with a config.
TOOL_UNITS = {"rlharvest-etcd-maintenance": ["etcd-maintain"]}


@pytest.mark.parametrize("unit", sorted(p for p in (ROOT / "deploy" / "systemd").glob("*.service")
                                        if p.stem not in TOOL_UNITS), ids=lambda p: p.name)
def test_systemd_unit_is_well_formed(unit: Path):
    parser = _read_unit(unit)
    assert set(parser.sections()) == {"Unit", "Service", "Install"}
    service = parser["Service"]
    assert service["KillSignal"] == "SIGTERM"
    assert int(service["TimeoutStopSec"]) > 0
    argv = shlex.split(service["ExecStart"])
    assert argv[0].startswith("/"), "systemd needs an absolute ExecStart path"
    assert Path(argv[0]).name == unit.stem
    config_file = _check_command(argv)
    assert config_file is not None, f"{unit.name} runs without --config"
    example = ROOT / "deploy" / (Path(config_file).name.replace(".toml", ".example.toml"))
    assert example.is_file(), f"no example for {config_file}"
    cfg = load_config(CONFIGS[unit.stem], example)  # the example config itself must load
    # A directory the service writes under /var/lib must exist and be its user's on a fresh
    # host: systemd makes it from StateDirectory= (relative to /var/lib).
    states = {f"/var/lib/{d}" for d in service.get("StateDirectory", "").split()}
    for name, value in cfg.model_dump().items():
        if name.endswith("_dir") and isinstance(value, str) and value.startswith("/var/lib/"):
            assert value in states, f"{unit.name}: {name} {value} has no StateDirectory="


@pytest.mark.parametrize("stem", sorted(TOOL_UNITS))
def test_a_tool_unit_runs_its_subcommand_with_flags_it_takes(stem: str):
    service = _read_unit(ROOT / "deploy" / "systemd" / f"{stem}.service")["Service"]
    assert service["KillSignal"] == "SIGTERM" and int(service["TimeoutStopSec"]) > 0
    argv = shlex.split(service["ExecStart"])
    assert argv[0] == "/usr/local/bin/rlharvest" and argv[1:2] == TOOL_UNITS[stem]
    check_tool_command(argv)


def check_tool_command(argv: list[str]) -> dict[str, Any]:
    """``rlharvest <subcommand> <flags>`` as its parser takes it (an unknown subcommand or flag,
    or a bad value, raises); returns the parsed parameters. Compose and Kubernetes use it too."""
    assert Path(argv[0]).name == "rlharvest", argv
    command = typer.main.get_command(cli_main.app)
    with command.make_context("rlharvest", argv[1:], resilient_parsing=False) as ctx:
        sub = command.get_command(ctx, argv[1])  # type: ignore[attr-defined]
        assert sub is not None, f"rlharvest has no subcommand {argv[1]!r}"
        with sub.make_context(argv[1], argv[2:]) as sub_ctx:
            return dict(sub_ctx.params)


def test_the_tool_check_refuses_a_wrong_subcommand_or_flag():
    check_tool_command(["rlharvest", "etcd-maintain", "--metrics-port", "9400"])
    for argv in (["rlharvest", "etcd-maintenance", "--metrics-port", "9400"],
                 ["rlharvest", "etcd-maintain", "--metric-port", "9400"],
                 ["rlharvest", "etcd-maintain", "--keep-s", "an hour"]):
        with pytest.raises((AssertionError, USAGE_ERROR)):
            check_tool_command(argv)


def test_compose_runs_one_etcd_maintainer_per_etcd_member():
    """compose's one etcd member gets one maintainer, dialing it by the stack's endpoint."""
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    maintainers = {name: svc for name, svc in services.items()
                   if svc.get("command", [])[:2] == ["rlharvest", "etcd-maintain"]}
    assert list(maintainers) == ["etcd-maintenance"]
    svc = maintainers["etcd-maintenance"]
    with pytest.MonkeyPatch.context() as mp:  # the endpoint comes from RLH_ETCD, as typer reads it
        for name in [n for n in os.environ if n.startswith("RLH_")]:
            mp.delenv(name)
        mp.setenv("RLH_ETCD", svc["environment"]["RLH_ETCD"])
        params = check_tool_command(svc["command"])
    assert params["etcd"] == "etcd:2379" and params["metrics_port"] > 0


def test_the_multi_rank_trainer_entries_launch_the_trainer_under_torchrun():
    """The compose profile and the systemd drop-in run ranks of the same trainer, with a
    backend that can reduce across ranks and a valid config."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    ranked = compose["trainer-ranks"]
    assert ranked["command"][0] == "torchrun" and ranked["profiles"] == ["ranks"]
    assert _config_of(ranked["command"]).backend == "deepspeed"
    drop_in = ROOT / "deploy" / "systemd" / "rlharvest-trainer.service.d" / "ranks.conf"
    lines = [line.split("=", 1) for line in drop_in.read_text().splitlines()
             if line and not line.startswith(("#", "["))]
    exec_starts = [value for key, value in lines if key == "ExecStart"]
    assert exec_starts[0] == "", "a drop-in must clear the unit's ExecStart first"
    argv = shlex.split(exec_starts[1])
    assert argv[0].startswith("/") and Path(argv[0]).name == "torchrun"
    config_file = _check_command(argv)
    assert config_file is not None, "the ranks drop-in runs without --config"
    example = ROOT / "deploy" / Path(config_file).name.replace(".toml", ".example.toml")
    assert load_config(TrainerConfig, example).backend == "deepspeed"


UNITS = sorted((ROOT / "deploy" / "systemd").glob("*.service"))
SYSTEM_UNITS = Path("/usr/lib/systemd/system")


def _verify_root(tmp_path: Path, executables) -> Path:
    """A bare-metal node as the units expect it: the units (and the trainer's drop-in) in
    /etc/systemd/system, this host's own system units (the targets a service's default
    dependencies name), and ``executables`` in /usr/local/bin, where ``pip install`` as root puts
    the package's console scripts."""
    root = tmp_path / "node"
    shutil.copytree(ROOT / "deploy" / "systemd", root / "etc" / "systemd" / "system")
    shutil.copytree(SYSTEM_UNITS, root / "usr" / "lib" / "systemd" / "system", symlinks=True)
    bin_dir = root / "usr" / "local" / "bin"
    bin_dir.mkdir(parents=True)
    for name in executables:
        (bin_dir / name).write_text("#!/bin/sh\n")
        (bin_dir / name).chmod(0o755)
    return root


def _systemd_analyze_verify(root: Path, unit: str) -> subprocess.CompletedProcess:
    return subprocess.run(["systemd-analyze", "verify", f"--root={root}", unit],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "SYSTEMD_LOG_COLOR": "0"})


needs_systemd_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None or not SYSTEM_UNITS.is_dir(),
    reason="systemd-analyze (Debian's systemd package) or /usr/lib/systemd/system is absent")


@needs_systemd_analyze
@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_systemd_analyze_verify_passes_on_the_unit_and_its_drop_ins(unit: Path, tmp_path: Path):
    """systemd's own verifier, on a node where the package is installed: every key is known, the
    dependencies resolve, ExecStart (the drop-in's too, for the trainer) names an executable.
    Nothing printed counts as passing: verify exits 0 on an unknown key, but says so."""
    root = _verify_root(tmp_path, [*SCRIPTS, "torchrun"])
    result = _systemd_analyze_verify(root, unit.name)
    assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), (
        f"systemd-analyze verify {unit.name}:\n{result.stdout}{result.stderr}")


@needs_systemd_analyze
def test_systemd_analyze_verify_catches_a_bad_key_and_a_missing_executable(tmp_path: Path):
    """The check above is not vacuous: on the same node, a misspelled key and the drop-in's
    torchrun left uninstalled are both reported."""
    root = _verify_root(tmp_path, [s for s in SCRIPTS])  # no torchrun
    result = _systemd_analyze_verify(root, "rlharvest-trainer.service")
    assert result.returncode != 0 and "torchrun" in result.stderr
    unit = root / "etc" / "systemd" / "system" / "rlharvest-rollout-worker.service"
    unit.write_text(unit.read_text().replace("TimeoutStopSec=", "TimeoutStopSecs="))
    result = _systemd_analyze_verify(root, unit.name)
    assert "Unknown key 'TimeoutStopSecs'" in result.stdout + result.stderr
