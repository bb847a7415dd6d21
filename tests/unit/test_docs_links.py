"""The docs can be navigated: every relative link in the README, the docs site's pages and the
benchmarks' README leads to a file that exists, and the README stays short enough to scan."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", ROOT / "bench" / "README.md",
                *(ROOT / "docs").rglob("*.md"), *(ROOT / "bench" / "results").glob("*.md")])
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
CODE_SPAN = re.compile(r"`[^`\n]*`")
INDENTED_CODE = re.compile(r"(?:^(?: {4}|\t).*\n?)+", re.M)


def relative_links(page: Path) -> list[str]:
    """The relative link targets of a Markdown page, code blocks and spans left out."""
    text = FENCE.sub("", page.read_text())
    text = CODE_SPAN.sub("", text)
    targets = [m.group(1) for m in LINK.finditer(text)]
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:|^#", t)]


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_relative_link_resolves_to_an_existing_file(page: Path):
    broken = [t for t in relative_links(page)
              if not (page.parent / t.split("#", 1)[0]).resolve().exists()]
    assert not broken, f"{_name(page)} links to files that do not exist: {broken}"


def test_readme_is_under_250_lines():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines < 250, f"README.md has {lines} lines; move detail into docs/"


def test_readme_links_into_the_docs_site():
    targets = relative_links(ROOT / "README.md")
    assert any(t.startswith("docs/") for t in targets)
    for page in ("architecture.md", "glossary.md", "security.md", "services/index.md"):
        assert f"docs/{page}" in targets, f"README.md does not link docs/{page}"


def test_links_in_code_are_not_links(tmp_path: Path):
    page = tmp_path / "p.md"
    page.write_text("[a](real.md) `[b](span.md)`\n\n```\n[c](fence.md)\n```\n[d](https://x.org) [e](#top)\n")
    assert relative_links(page) == ["real.md"]


def test_no_issue_numbers_in_the_docs_or_the_code():
    code = [p for d in ("rlharvest", "tests", "tools", "bench", "deploy")
            for p in (ROOT / d).rglob("*") if p.is_file() and p.suffix in (".py", ".md", ".toml", ".yml", ".yaml", ".sh")
            and "pb" not in p.relative_to(ROOT).parts]
    cited = [f"{_name(p)}: {m.group(0)}" for p in [*PAGES, *code]
             for m in re.finditer(r"\b[Ii]ssues? #?\d+", p.read_text())]
    assert not cited, f"issue numbers cited: {cited}"
