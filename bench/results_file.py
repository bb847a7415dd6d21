"""Where a benchmark writes its figures: ``bench/results/<name>.md`` for a full run, and
``<name>_quick.md`` for ``--quick`` (what ``make bench`` runs), so that a quick run never
overwrites the full figures bench/README.md cites. Imported by the bench scripts, which run
with ``bench/`` on their path."""

from __future__ import annotations

from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def results_path(name: str, quick: bool) -> Path:
    RESULTS_DIR.mkdir(exist_ok=True)
    return RESULTS_DIR / f"{name}{'_quick' if quick else ''}.md"
