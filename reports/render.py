"""Render a run directory's reports from its journal: what the runner calls at the end of a run
and what `pdchaos report RUN_DIR` calls at any time after (a crashed run included).

Each file is written to a temporary name and renamed, so a reader (or a CI upload) never sees a
half-written report, and one renderer's bug does not cost the others their files.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from reports.formats import ALWAYS, FILENAMES
from reports.html import render_html
from reports.json_report import render_json
from reports.junit import render_junit
from reports.markdown import render_markdown
from reports.model import RunReport, load_run
from reports.reproduce import render_reproduce

_RENDERERS: dict[str, Callable[[RunReport], str]] = {
    "html": render_html,
    "junit": render_junit,
    "json": render_json,
    "markdown": render_markdown,
    "reproduce": render_reproduce,
}
# Format name -> file name and renderer.
FORMATS: dict[str, tuple[str, Callable[[RunReport], str]]] = {
    name: (FILENAMES[name], _RENDERERS[name]) for name in FILENAMES
}


class RenderError(Exception):
    """Some renderers failed; the others' files were written."""


@dataclass(frozen=True)
class Rendered:
    report: RunReport
    paths: dict[str, Path] = field(default_factory=dict)  # format -> file written


def render_all(
    run_dir: str | Path, formats: Iterable[str] | None = None, *, out_dir: str | Path | None = None
) -> Rendered:
    """Read RUN_DIR's journal once and write the reports into `out_dir` (default: RUN_DIR).

    `formats`: names from FORMATS; None means the campaign's `report.formats` (all of them when
    the journal holds no campaign). reproduce.yaml is always written. Raises FileNotFoundError
    when RUN_DIR has no journal, ValueError on an unknown format, RenderError when a renderer
    failed (after writing every other file).
    """
    run_dir = Path(run_dir)
    report = load_run(run_dir)
    chosen = _choose(formats, report)
    target = Path(out_dir) if out_dir is not None else run_dir
    target.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    errors: list[str] = []
    for name in chosen:
        filename, renderer = FORMATS[name]
        try:
            paths[name] = write_atomic(target / filename, renderer(report))
        except Exception as exc:  # keep going: the other reports are still worth having
            errors.append(f"{filename}: {type(exc).__name__}: {exc}")
    if errors:
        raise RenderError("could not render " + "; ".join(errors))
    return Rendered(report, paths)


def _choose(formats: Iterable[str] | None, report: RunReport) -> list[str]:
    if formats is None:
        campaign = report.meta.get("campaign")
        spec = campaign.get("report") if isinstance(campaign, dict) else None
        wanted = spec.get("formats") if isinstance(spec, dict) else None
        formats = wanted if isinstance(wanted, list) else list(FORMATS)
    chosen = list(dict.fromkeys([*formats, *ALWAYS]))
    unknown = [f for f in chosen if f not in FORMATS]
    if unknown:
        raise ValueError(f"unknown report format(s) {', '.join(unknown)}; choose from {', '.join(FORMATS)}")
    return chosen


def write_atomic(path: Path, text: str) -> Path:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
