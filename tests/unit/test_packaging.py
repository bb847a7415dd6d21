"""The package resolves from the checkout under test, statically, and installs whole."""

import os
import subprocess
import sys

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib
from pathlib import Path

from setuptools import find_packages

import rlharvest

ROOT = Path(__file__).resolve().parents[2]


def test_rlharvest_is_imported_from_the_checkout_under_test():
    assert Path(rlharvest.__file__).resolve().parent == ROOT / "rlharvest", (
        f"rlharvest came from {rlharvest.__file__}, not from the checkout {ROOT}: another "
        "checkout's install is shadowing this one")


def test_service_processes_import_the_checkout_under_test(tmp_path: Path):
    # Children inherit the PYTHONPATH the test session sets; run from elsewhere to prove that
    # the working directory is not what makes it resolve.
    out = subprocess.run([sys.executable, "-c", "import rlharvest.cli.launcher as l; "
                          "print(l.__file__)"], cwd=tmp_path, capture_output=True, text=True,
                         env=os.environ.copy(), check=True).stdout.strip()
    assert Path(out).resolve() == ROOT / "rlharvest" / "cli" / "launcher.py"


def test_the_launcher_puts_its_checkout_first_for_service_processes(monkeypatch):
    # Without this a service process would import whichever checkout was installed last.
    from rlharvest.cli.launcher import child_environment

    monkeypatch.delenv("PYTHONPATH", raising=False)
    assert child_environment()["PYTHONPATH"].split(os.pathsep) == [str(ROOT)]
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    assert child_environment()["PYTHONPATH"].split(os.pathsep) == [str(ROOT), "/elsewhere"]


def test_every_package_folder_is_found_by_setuptools():
    found = set(find_packages(str(ROOT), include=["rlharvest*"]))
    expected = {".".join(init.parent.relative_to(ROOT).parts)
                for init in (ROOT / "rlharvest").rglob("__init__.py")}
    assert expected - found == set(), "these packages would be missing from a built wheel"


def test_torch_range_admits_the_local_cpu_build():
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    torch = next(Requirement(d) for d in project["project"]["dependencies"] if d.startswith("torch"))
    assert torch.specifier.contains("2.13.0")
