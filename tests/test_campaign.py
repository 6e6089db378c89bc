"""Campaign validation: every malformed campaign is exit 2 with the field named and no traceback."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import yaml

from chaos.campaign_validation import load_campaign, parse_campaign
from chaos.errors import UsageError
from tests.conftest import run_cli

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "campaign, field, hint",
    [
        ({"seed": 1}, "name", "required field is missing"),
        ({"name": "x", "load": {"users": "many"}}, "load.users", "valid integer"),
        ({"name": "x", "load": {"duration": "-5s"}}, "load.duration", "duration"),
        ({"name": "x", "load": {"profile": "nope"}}, "load.profile", "choose one of"),
        (
            {"name": "x", "faults": {"windows": [{"fault": "meteor_strike", "at": "5s", "duration": "5s"}]}},
            "faults.windows[0].fault",
            "known faults",
        ),
        (
            {"name": "x", "faults": {"windows": [{"fault": "transfer_stall", "at": "5s", "duration": "-2s"}]}},
            "faults.windows[0].duration",
            "duration",
        ),
        (
            {
                "name": "x",
                "faults": {
                    "windows": [{"fault": "transfer_stall", "at": "5s", "duration": "5s", "params": {"role": "gpu"}}]
                },
            },
            "faults.windows[0].params.role",
            "not one of",
        ),
        (
            {
                "name": "x",
                "load": {"duration": "10s"},
                "faults": {"windows": [{"fault": "transfer_stall", "at": "8s", "duration": "5s"}]},
            },
            "faults.windows[0]",
            "after the load",
        ),
        ({"name": "x", "target": {"kind": "attach"}}, "target", "needs url"),
        ({"name": "x", "target": {"sim": {"defects": ["nope"]}}}, "target.sim.defects", "unknown defect"),
        ({"name": "x", "oracles": {"enabled": ["crystal_ball"]}}, "oracles.enabled", "unknown oracle"),
        ({"name": "x", "lod": {}}, "lod", "unknown field"),
        (
            {"name": "x", "target": {"sim": {"prefill": {"max_total_tokenz": 4096}}}},
            "target.sim.prefill",
            "unknown setting",
        ),
        (
            {"name": "x", "faults": {"windows": [{"fault": "transfer_stall", "at": "5s", "duration": "2s"}]}},
            "faults: transfer_stall (window 0)",
            "can never be confirmed",
        ),
        (
            {"name": "x", "target": {"kind": "sglang", "sglang": {"model_path": "/m"}}},
            "oracles.reference_exact",
            "deterministic: true",
        ),
        (
            {
                "name": "x",
                "target": {"kind": "attach", "url": "http://127.0.0.1:9"},
                "faults": {"windows": [{"fault": "transfer_stall", "at": "5s", "duration": "9s"}]},
            },
            "faults: 'transfer_stall'",
            "gives no prefill pid",
        ),
        (
            {
                "name": "x",
                "target": {"kind": "vllm"},
                "faults": {"windows": [{"fault": "engine_failure", "at": "5s", "duration": "9s"}]},
            },
            "faults: 'engine_failure'",
            "does not apply to a vllm target",
        ),
    ],
)
def test_malformed_campaigns_name_the_field_and_exit_2(tmp_path: Path, campaign: dict, field: str, hint: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(campaign))
    result = run_cli("run", str(path), "--out", str(tmp_path / "run"))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert field in result.stderr and hint in result.stderr, result.stderr
    assert not (tmp_path / "run").exists()  # validated before touching anything


def test_not_yaml_and_missing_files_are_usage_errors(tmp_path: Path) -> None:
    bad = tmp_path / "broken.yaml"
    bad.write_text("name: [unclosed\n")
    for args in (("run", str(bad)), ("run", str(tmp_path / "absent.yaml"))):
        result = run_cli(*args)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr


def test_a_defect_on_a_real_engine_campaign_is_a_usage_error(tmp_path: Path) -> None:
    result = run_cli(
        "run",
        str(ROOT / "campaigns" / "sglang-cpu.yaml"),
        "--defect",
        "pages_leak_on_abort",
        "--out",
        str(tmp_path / "run"),
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "--defect" in result.stderr and "target.kind: sim" in result.stderr
    assert not (tmp_path / "run").exists()


def test_an_unreachable_attach_target_is_a_usage_error(tmp_path: Path) -> None:
    path = tmp_path / "attach.yaml"
    path.write_text(
        yaml.safe_dump(
            {"name": "remote", "target": {"kind": "attach", "url": "http://127.0.0.1:9"}, "load": {"duration": "10s"}}
        )
    )
    result = run_cli("run", str(path), "--out", str(tmp_path / "run"), "--quiet")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "target.url" in result.stderr and "Traceback" not in result.stderr


def test_the_shipped_campaigns_validate() -> None:
    paths = sorted((ROOT / "campaigns").rglob("*.yaml"))
    assert len(paths) >= 15 and ROOT / "campaigns" / "default.yaml" in paths, paths  # none moved away unseen
    for path in paths:
        load_campaign(path)


def test_a_random_schedule_is_reproducible_from_its_seed() -> None:
    spec = {
        "name": "r",
        "seed": 4,
        "load": {"duration": "10m"},
        "faults": {
            "random": {
                "count": 5,
                "faults": ["transfer_stall", "process_kill"],
                "min_duration": "5s",
                "max_duration": "9s",
            }
        },
    }
    first = [(w.fault, w.at_s, w.duration_s) for w in parse_campaign(spec).windows()]
    again = [(w.fault, w.at_s, w.duration_s) for w in parse_campaign(spec).windows()]
    other = [(w.fault, w.at_s, w.duration_s) for w in parse_campaign({**spec, "seed": 5}).windows()]
    assert first == again and first != other
    assert all(5 <= d <= 9 for _, _, d in first)
    assert all(b[1] >= a[1] + a[2] for a, b in itertools.pairwise(first))  # one at a time, in order


def test_schema_is_json_and_documents_the_campaign() -> None:
    result = run_cli("schema")
    assert result.returncode == 0
    schema = json.loads(result.stdout)
    assert {"target", "load", "faults", "oracles", "gates", "seed"} <= set(schema["properties"])


def test_parse_errors_are_usage_errors_not_exceptions() -> None:
    with pytest.raises(UsageError):
        parse_campaign(["not", "a", "mapping"])
