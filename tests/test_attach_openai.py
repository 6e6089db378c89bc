"""Attach to a plain OpenAI-compatible server: no /generate, /server_info, worker URLs or abort
endpoint. The faults speak its routes (client aborts by disconnecting, confirmed by the client's
own ending since the server counts none), the probes and the load name the model it lists, and
an over-length prompt counts as rejected only when the server's 400 says it is about length.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.openai_server import AuthEchoServer

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[1]


def test_a_run_against_a_plain_openai_server_confirms_its_aborts_and_fails_nothing(tmp_path: Path) -> None:
    with AuthEchoServer(None, token_delay_s=0.02) as server:
        campaign = {
            "name": "openai-attach",
            "seed": 5,
            "target": {"kind": "attach", "url": server.url},
            "load": {"profile": "canary-chat", "users": 2, "duration": "30s", "max_tokens": 16},
            "probes": {"count": 2, "interval": "1s"},
            "faults": {
                "windows": [
                    {
                        "fault": "client_abort",
                        "at": "4s",
                        "duration": "10s",
                        "params": {"phase": "decode", "method": "disconnect", "count": 3, "prompt_tokens": 200},
                    },
                    {"fault": "over_length_burst", "at": "18s", "duration": "8s", "params": {"count": 2}},
                ]
            },
        }
        path = tmp_path / "campaign.yaml"
        path.write_text(yaml.safe_dump(campaign))
        out = tmp_path / "run"
        env = {k: v for k, v in os.environ.items() if k != "PDCHAOS_TRANSPORT"}
        done = subprocess.run(
            [sys.executable, "-m", "chaos.cli", "run", str(path), "--out", str(out), "--json"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=400,
        )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["verdict"] != "FAIL", result["reasons"]
    db = sqlite3.connect(out / "journal.sqlite")
    steps = [
        (name, json.loads(data)) for name, data in db.execute("SELECT name, data FROM events WHERE kind = 'fault'")
    ]
    confirmations = {name: data for name, data in steps if data.get("step") == "confirm"}
    assert set(confirmations) == {"client_abort", "over_length_burst"}, steps
    for fault, data in confirmations.items():
        assert data["confirmed"] is True, (fault, data)
    assert "confirmed by the client's ending" in confirmations["client_abort"]["evidence"]
    # every request the suite sent went to an OpenAI route, none to /generate
    endpoints = {row[0] for row in db.execute("SELECT DISTINCT endpoint FROM requests")}
    assert endpoints and all(e.startswith("/v1/") for e in endpoints), endpoints
    # no INCONCLUSIVE for want of a route the server lacks
    assert not any("not found" in r or "no token" in r for r in result["reasons"]), result["reasons"]


def test_a_client_abort_whose_requests_finish_first_is_not_confirmed() -> None:
    """On a target that counts no aborts, the client's own ending is the only evidence: a server
    that answers every request whole (it ignores `stream`) finishes each one before the first
    streamed token could trigger the disconnect, so the window must stay unconfirmed."""
    from chaos.targets.attach import AttachTarget
    from chaos.targets.dialect import OPENAI
    from faults.base import FaultContext
    from faults.registry import build_fault
    from faults.window import run_window

    params = {"phase": "decode", "method": "disconnect", "count": 2, "prompt_tokens": 200}
    with AuthEchoServer(None, streams=False) as server:
        target = AttachTarget(server.url, dialect=OPENAI)
        result = run_window(build_fault("client_abort", params, "faults[0]"), FaultContext(target), duration_s=0.5)
    evidence = result.confirmation.evidence
    assert not result.confirmation.confirmed, evidence
    assert "0/2 ended as a disconnect" in evidence and "200 stop x2" in evidence, evidence
    assert "confirmed by the client's ending" in evidence  # what the (missing) confirmation rests on

    with AuthEchoServer(None, token_delay_s=0.05) as server:  # the same fault where the stream is slow
        target = AttachTarget(server.url, dialect=OPENAI)
        result = run_window(build_fault("client_abort", params, "faults[0]"), FaultContext(target), duration_s=0.5)
    assert result.confirmation.confirmed, result.confirmation.evidence
    assert "2/2 ended as a disconnect" in result.confirmation.evidence
