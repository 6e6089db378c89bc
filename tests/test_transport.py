"""Credentials and TLS (chaos/transport.py): the key reaches the target and nothing else.

Against a gateway-like server that demands a bearer token and echoes every request header into
its replies (tests/openai_server.py): a run with the key in the named variable gets answers and
leaves no byte of the key in its run directory; a wrong key, or a certificate nobody trusts, stops
the run with exit 2 and a message that names the variable or the option, never the key.
"""

from __future__ import annotations

import os
import sqlite3
import ssl
import subprocess
import sys
from pathlib import Path

import pytest
import trustme
import yaml

from chaos import transport
from chaos.campaign_validation import parse_campaign
from chaos.cli.access import access_overrides
from chaos.errors import UsageError
from chaos.journal import Journal, Outcome, RequestRecord
from chaos.targets.spec import TargetSpec
from chaos.transport import Transport, scrub_tree
from tests.openai_server import AuthEchoServer

pytestmark = pytest.mark.usefixtures("fresh_transport")
REPO = Path(__file__).resolve().parents[1]
KEY = "sk-pdchaos-test-7f3a9c41d2e8b605"
WRONG = "sk-pdchaos-wrong-0000000000000000"
VAR = "PDCHAOS_TEST_API_KEY"


# ------------------------------------------------------------------------------ unit ----


def test_the_key_goes_in_the_bearer_header_and_the_workers_may_take_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(VAR, KEY)
    monkeypatch.setenv("WORKER_KEY", "sk-worker-key-123456")
    chosen = Transport(
        api_key_env=VAR,
        worker_api_key_env="WORKER_KEY",
        worker_urls=("http://10.0.0.2:30100",),
        headers=(("X-Tenant", "blue"),),
    )
    assert chosen.request_headers("http://10.0.0.1:30000/v1/models") == {
        "X-Tenant": "blue",
        "Authorization": f"Bearer {KEY}",
    }
    assert chosen.request_headers("http://10.0.0.2:30100/metrics")["Authorization"] == "Bearer sk-worker-key-123456"


def test_the_settings_children_inherit_hold_the_variable_name_never_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(VAR, KEY)
    chosen = Transport(api_key_env=VAR, header_env=(("X-Gateway-Token", "GW"),), ca_bundle="/ca.pem")
    encoded = chosen.to_env()
    assert KEY not in encoded and VAR in encoded
    assert Transport.from_env(encoded) == chosen


def test_an_unset_variable_is_a_usage_error_that_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(VAR, raising=False)
    with pytest.raises(UsageError, match=VAR):
        Transport(api_key_env=VAR).check_variables()


def test_redact_and_scrub_remove_every_byte_of_the_key_and_keep_file_sizes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(VAR, KEY)
    transport.configure(Transport(api_key_env=VAR))
    assert transport.redact(f"echo: Authorization=Bearer {KEY}") == "echo: Authorization=Bearer [redacted]"
    log = tmp_path / "logs" / "router.log"
    log.parent.mkdir()
    log.write_bytes(f"header {KEY} twice {KEY}\n".encode())
    size = log.stat().st_size
    assert scrub_tree(tmp_path) == [log]
    assert KEY.encode() not in log.read_bytes() and log.stat().st_size == size


def test_the_journal_never_stores_a_key_a_target_echoed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(VAR, KEY)
    transport.configure(Transport(api_key_env=VAR))
    with Journal.create(tmp_path) as journal:
        journal.append_request(
            RequestRecord(
                id="r1",
                request_index=1,
                endpoint="/v1/completions",
                t_send=1.0,
                outcome=Outcome.OK,
                status=200,
                response_text=f"(headers: Authorization=Bearer {KEY})",
            )
        )
        journal.set_meta("echo", {"body": KEY})
    raw = b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.is_file())
    assert KEY.encode() not in raw
    rows = sqlite3.connect(tmp_path / "journal.sqlite").execute("SELECT response_text FROM requests").fetchall()
    assert rows == [("(headers: Authorization=Bearer [redacted])",)]


def test_a_campaign_names_variables_and_refuses_a_pasted_key_without_echoing_it() -> None:
    spec = TargetSpec.model_validate(
        {"kind": "attach", "url": "https://gw.example:443", "api_key_env": VAR, "headers": {"X-Tenant": "blue"}}
    )
    assert spec.transport().api_key_env == VAR
    with pytest.raises(UsageError, match=r"target\.api_key_env: must name an environment variable") as pasted:
        parse_campaign({"name": "c", "target": {"kind": "attach", "url": "http://x:1", "api_key_env": KEY}}, "c.yaml")
    assert KEY not in str(pasted.value)
    with pytest.raises(ValueError, match="header_env"):
        TargetSpec.model_validate({"kind": "attach", "url": "http://x:1", "headers": {"Authorization": "Bearer x"}})


def test_the_flags_mirror_the_campaign_fields() -> None:
    import argparse

    from chaos.cli.access import add_access_arguments

    parser = argparse.ArgumentParser()
    add_access_arguments(parser)
    args = parser.parse_args(
        ["--api-key-env", VAR, "--header", "X-Tenant: blue", "--header-env", "X-Gateway-Token=GW", "--insecure"]
    )
    assert access_overrides(args) == {
        "api_key_env": VAR,
        "headers": {"X-Tenant": "blue"},
        "header_env": {"X-Gateway-Token": "GW"},
        "insecure": True,
    }
    with pytest.raises(UsageError, match="header-env"):
        access_overrides(parser.parse_args(["--header", "Authorization: Bearer abc"]))


# ---------------------------------------------------------------------- end to end ----


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


def _server_tls(ca: trustme.CA) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost", "127.0.0.1").configure_cert(context)
    return context


def _campaign(tmp_path: Path, url: str, **target: object) -> Path:
    path = tmp_path / "campaign.yaml"
    campaign = {
        "name": "credentials",
        "seed": 3,
        "target": {"kind": "attach", "url": url, "api_key_env": VAR, **target},
        "load": {"profile": "canary-chat", "users": 2, "duration": "6s"},
        "probes": {"count": 2, "interval": "1s"},
        "faults": {"windows": []},
    }
    path.write_text(yaml.safe_dump(campaign))
    return path


def _pdchaos(*argv: str | Path, key: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, VAR: key}
    env.pop(transport.ENV, None)
    return subprocess.run(
        [sys.executable, "-m", "chaos.cli", *map(str, argv)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _files_holding(root: Path, secret: str) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


@pytest.mark.integration
def test_a_run_over_https_with_the_key_gets_answers_and_leaves_no_byte_of_it(tmp_path: Path, ca: trustme.CA) -> None:
    bundle = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(bundle))
    with AuthEchoServer(KEY, tls=_server_tls(ca)) as server:
        out = tmp_path / "run"
        done = _pdchaos("run", _campaign(tmp_path, server.url, ca_bundle=str(bundle)), "--out", out, key=KEY)
        assert done.returncode in (0, 1, 3), done.stderr[-3000:]
        assert server.unauthorized == 0  # every request carried the key: users, probes, discovery
    assert KEY not in done.stdout + done.stderr
    assert _files_holding(out, KEY) == []
    db = sqlite3.connect(out / "journal.sqlite")
    answered = db.execute("SELECT COUNT(*) FROM requests WHERE status = 200").fetchone()[0]
    assert answered >= 10
    # the server echoed the header into its replies: the journal kept the reply, not the key
    echoed = db.execute("SELECT COUNT(*) FROM requests WHERE response_text LIKE '%Bearer [redacted]%'").fetchone()[0]
    assert echoed >= 1


@pytest.mark.integration
def test_a_wrong_key_stops_the_run_with_exit_2_naming_the_variable_not_the_key(tmp_path: Path) -> None:
    with AuthEchoServer(KEY) as server:
        out = tmp_path / "run"
        done = _pdchaos("run", _campaign(tmp_path, server.url), "--out", out, key=WRONG, timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    assert VAR in done.stderr and "Traceback" not in done.stderr
    assert WRONG not in done.stdout + done.stderr and KEY not in done.stderr
    assert _files_holding(out, WRONG) == []  # the gateway's error body quoted it


@pytest.mark.integration
def test_an_untrusted_certificate_stops_the_run_and_names_the_ca_option(tmp_path: Path, ca: trustme.CA) -> None:
    with AuthEchoServer(KEY, tls=_server_tls(ca)) as server:
        done = _pdchaos("run", _campaign(tmp_path, server.url), "--out", tmp_path / "run", key=KEY, timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "ca_bundle" in done.stderr and "--ca-bundle" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.integration
def test_canary_sends_the_key_and_a_wrong_one_exits_2(tmp_path: Path) -> None:
    with AuthEchoServer(KEY) as server:
        ok = _pdchaos("canary", "--url", server.url, "--api-key-env", VAR, "--json", key=KEY, timeout=120)
        assert server.unauthorized == 0, ok.stderr[-2000:]
        wrong = _pdchaos("canary", "--url", server.url, "--api-key-env", VAR, key=WRONG, timeout=60)
    assert ok.returncode in (0, 1, 3), ok.stderr[-2000:]
    assert KEY not in ok.stdout + ok.stderr
    assert wrong.returncode == 2 and VAR in wrong.stderr and WRONG not in wrong.stderr
