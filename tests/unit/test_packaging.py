"""pyproject lists every package: the rlharvest.* mapping cannot be discovered automatically."""

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_folder_is_listed_in_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    mapping = project["tool"]["setuptools"]["package-dir"]
    listed = set(project["tool"]["setuptools"]["packages"])
    found = set()
    for package, folder in mapping.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([package, *rel.parts]) if rel.parts else package)
    assert found - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
    assert listed - found == set(), "these listed packages have no folder"


def test_torch_range_admits_the_local_cpu_build():
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    torch = next(Requirement(d) for d in project["project"]["dependencies"] if d.startswith("torch"))
    assert torch.specifier.contains("2.13.0")
