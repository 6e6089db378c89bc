"""`pdchaos plan`: the exact commands a campaign's target would start, with nothing started."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psutil

from chaos.cli import main


def _our_servers() -> set[int]:
    return {
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if any(
            part in ("chaos.targets.sim.worker", "sglang_router.launch_router") for part in (p.info["cmdline"] or [])
        )
    }


def test_plan_lists_every_process_of_the_embedded_stack_and_starts_none(tmp_path: Path) -> None:
    before = _our_servers()
    out = subprocess.run(
        [sys.executable, "-m", "chaos.cli", "plan", "campaigns/default.yaml", "--json", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    plan = [json.loads(line) for line in out.stdout.splitlines()]
    names = [p["name"] for p in plan]
    assert names == ["proxy_router_prefill", "proxy_router_decode", "proxy_kv_transfer", "prefill", "decode", "router"]
    by_name = {p["name"]: p for p in plan}
    prefill, router = by_name["prefill"], by_name["router"]
    assert prefill["argv"][prefill["argv"].index("--disaggregation-mode") + 1] == "prefill"
    assert prefill["env"]["SGLANG_DISAGGREGATION_WAITING_TIMEOUT"] == "3.0"  # the campaign's shortened timeout
    assert "--pd-disaggregation" in router["argv"] and "--disable-retries" in router["argv"]
    assert "<router_prefill proxy>" in router["argv"]  # proxies pick their ports only when they start
    assert router["ready_url"].endswith("/readiness") and prefill["ready_url"].endswith("/health")
    assert prefill["log"] == str(tmp_path / "logs" / "prefill.log")
    assert all(p["placement"] == "this machine" for p in plan)
    assert _our_servers() <= before  # nothing was started
    assert not (tmp_path / "target.json").exists()


def test_plan_shows_the_ray_placement_without_contacting_ray(capsys: object) -> None:
    assert main(["plan", "campaigns/default.yaml", "--ray-address", "127.0.0.1:1"]) == 0
    text = capsys.readouterr().out  # type: ignore[attr-defined]
    assert "## prefill (the Ray node offering pdchaos_prefill)" in text
    assert "## router (the Ray node offering pdchaos_router, else the driver's node)" in text


def test_plan_of_an_attached_target_says_nothing_is_launched(tmp_path: Path, capsys: object) -> None:
    campaign = tmp_path / "attach.yaml"
    campaign.write_text("name: a\ntarget: {kind: attach, url: 'http://127.0.0.1:9'}\n")
    assert main(["plan", str(campaign)]) == 2
    assert "launches nothing" in capsys.readouterr().err  # type: ignore[attr-defined]
