"""docs/ci.md: both CI jobs are valid YAML of their system's shape, heal and keep the run whatever
happened, and every `pdchaos` command in them is one the real command line accepts; the exit-code
table agrees with the code."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from chaos.cli import build_parser
from chaos.exit_codes import ExitCode
from chaos.verdict import Verdict
from reports.compare import EXIT_OK, EXIT_REGRESSED, EXIT_UNPROVEN

DOC = Path(__file__).resolve().parent.parent / "docs" / "ci.md"
YAML_BLOCK = re.compile(r"```yaml\n(.*?)```", re.S)
# a pdchaos invocation up to the end of its shell command
COMMAND = re.compile(r"\.pdchaos/bin/pdchaos\s+([^;&|)\n]+)")
EXPRESSION = re.compile(r"\$\{\{[^}]*\}\}|\$\{?[A-Za-z_][A-Za-z0-9_]*\}?")


def _jobs() -> tuple[dict[str, Any], dict[str, Any]]:
    github, gitlab = (yaml.safe_load(block) for block in YAML_BLOCK.findall(DOC.read_text()))
    return github, gitlab


def _shell(job_text: str) -> list[list[str]]:
    """Every pdchaos command line in a job's shell text, variables filled with a placeholder."""
    commands = []
    for match in COMMAND.finditer(job_text):
        argv = shlex.split(EXPRESSION.sub("VALUE", match.group(1)))
        commands.append(argv)
    return commands


def _github_steps() -> list[dict[str, Any]]:
    github, _ = _jobs()
    (job,) = github["jobs"].values()
    steps: list[dict[str, Any]] = job["steps"]
    return steps


def test_the_doc_holds_a_github_and_a_gitlab_job() -> None:
    github, gitlab = _jobs()
    assert "jobs" in github and (True in github or "on" in github)  # YAML 1.1 reads `on:` as True
    (job,) = github["jobs"].values()
    assert job["timeout-minutes"] > 0 and all("run" in s or "uses" in s for s in job["steps"])
    (name,) = gitlab
    assert {"script", "after_script", "artifacts"} <= set(gitlab[name])


def test_the_github_job_heals_keeps_and_publishes_the_run_whatever_happened() -> None:
    steps = _github_steps()
    always = [s for s in steps if str(s.get("if", "")).startswith("always()")]
    assert any("pdchaos heal" in s.get("run", "") for s in always)
    assert any(s.get("uses", "").startswith("actions/upload-artifact@") for s in always)
    assert any("junit.xml" in str(s.get("with", {})) for s in always)
    gate = steps[-1]
    assert gate["if"] == "always()" and 'steps.run.outputs.code }}" = 0' in gate["run"]  # INCONCLUSIVE fails it
    order = [s.get("id") or s.get("name") for s in steps]
    assert order.index("run") < order.index("heal what an interrupted run left behind")


def test_the_gitlab_job_heals_in_after_script_and_keeps_the_run_always() -> None:
    _, gitlab = _jobs()
    (job,) = gitlab.values()
    assert any("pdchaos heal" in line for line in job["after_script"])
    assert job["artifacts"]["when"] == "always" and job["artifacts"]["reports"]["junit"].endswith("junit.xml")
    assert job["script"][-1] == "exit $code"


def test_every_pdchaos_command_in_the_jobs_is_accepted_by_the_real_command_line() -> None:
    parser = build_parser()
    text = DOC.read_text()
    commands = [argv for block in YAML_BLOCK.findall(text) for argv in _shell(block)]
    used = {argv[0] for argv in commands}
    assert {"preflight", "run", "heal", "compare"} <= used, used
    for argv in commands:
        try:
            parser.parse_args(argv)
        except SystemExit as exc:  # argparse rejects: it exits 2
            pytest.fail(f"docs/ci.md: `pdchaos {' '.join(argv)}` is not a valid command ({exc})")


def test_the_exit_code_table_says_what_the_code_returns() -> None:
    table = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[0].startswith("`pdchaos"):
            table[cells[0].strip("`")] = cells[1:]
    run = table["pdchaos run"]
    assert (run[Verdict.PASS.exit_code], run[Verdict.FAIL.exit_code], run[Verdict.INCONCLUSIVE.exit_code]) == (
        "PASS",
        "FAIL",
        "INCONCLUSIVE",
    )
    assert run[ExitCode.USAGE].startswith("bad campaign")
    compare = table["pdchaos compare BASE CANDIDATE"]
    assert compare[EXIT_OK] == "no regression" and compare[EXIT_REGRESSED].startswith("regressed")
    assert compare[EXIT_UNPROVEN].startswith("not proven")
