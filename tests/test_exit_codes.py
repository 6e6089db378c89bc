"""chaos/exit_codes.py is the one list of exit codes: `pdchaos --help`, README.md's table and the
columns of docs/ci.md's per-command table say what it says, and the codes the code returns are in it."""

from __future__ import annotations

import re
from pathlib import Path

from chaos.cli import build_parser
from chaos.exit_codes import ExitCode
from chaos.verdict import Verdict
from reports.compare import EXIT_OK, EXIT_REGRESSED, EXIT_UNPROVEN

ROOT = Path(__file__).resolve().parent.parent


def _exit_code_table(doc: Path) -> list[list[str]]:
    """The cells of each row of the table in `doc`'s "## Exit codes" section."""
    section = doc.read_text().split("\n## Exit codes\n", 1)[1].split("\n## ", 1)[0]
    lines = [line.strip() for line in section.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]


def test_the_codes_are_the_projects_conventions() -> None:
    assert [(c.name, int(c)) for c in ExitCode] == [
        ("PASS", 0),
        ("FAIL", 1),
        ("USAGE", 2),
        ("INCONCLUSIVE", 3),
        ("INTERRUPTED", 130),
    ]
    assert all(c.meaning and "\n" not in c.meaning for c in ExitCode)
    assert str(ExitCode.USAGE) == f"{ExitCode.USAGE}" == "2"  # printed as the number it exits with


def test_help_ends_with_the_table() -> None:
    text = build_parser().format_help()
    table = text[text.index("\nexit codes") :]
    rows = re.findall(r"^\s+(\d+)\s+(.+)$", table, re.M)
    assert [(int(code), meaning) for code, meaning in rows] == [(int(c), c.meaning) for c in ExitCode]


def test_the_readme_table_is_the_enum() -> None:
    header, rule, *rows = _exit_code_table(ROOT / "README.md")
    assert header == ["code", "meaning"] and set("".join(rule)) <= {"-"}
    assert [(int(code), meaning) for code, meaning in rows] == [(int(c), c.meaning) for c in ExitCode]


def test_the_ci_doc_has_a_column_for_every_code() -> None:
    header, *_ = _exit_code_table(ROOT / "docs" / "ci.md")
    assert header[0] == "command" and [int(cell) for cell in header[1:]] == [int(c) for c in ExitCode]


def test_verdicts_and_comparisons_exit_with_the_codes_of_their_names() -> None:
    assert [v.exit_code for v in Verdict] == [ExitCode.PASS, ExitCode.FAIL, ExitCode.INCONCLUSIVE]
    assert (EXIT_OK, EXIT_REGRESSED, EXIT_UNPROVEN) == (ExitCode.PASS, ExitCode.FAIL, ExitCode.INCONCLUSIVE)
