"""The report formats and their file names, importable without the renderers (the CLI builds its
parser from this, and `pdchaos --help` should not load numpy)."""

from __future__ import annotations

# Format name (as in a campaign's `report.formats`) -> file written into the run directory.
FILENAMES: dict[str, str] = {
    "html": "report.html",
    "junit": "junit.xml",
    "json": "report.json",
    "markdown": "summary.md",
    "reproduce": "reproduce.yaml",
}
ALWAYS = ("reproduce",)  # a run that cannot be replayed cannot be compared
