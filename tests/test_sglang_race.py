"""The real-SGLang tests' guard against SGLang's transfer-thread race (tests/sglang_race.py)."""

from __future__ import annotations

from pathlib import Path

from tests.sglang_race import TRANSFER_THREAD_DIED, RaceWatch, deaths_in_run

DEATH = (
    f"RuntimeError: {TRANSFER_THREAD_DIED} 6855142813804064824. Prefill instance with bootstrap_port=46015 is dead.\n"
)


class FakePair:
    def __init__(self) -> None:
        self.text = {"prefill": "Prefill batch, #new-seq: 1\n", "decode": ""}
        self.restarts: list[str] = []

    def logs(self, role: str) -> str:
        return self.text[role]

    def restart(self, role: str) -> None:
        self.restarts.append(role)
        self.text[role] += "Uvicorn running on http://127.0.0.1:1\n"  # the log appends across restarts


def test_prefill_is_restarted_once_per_new_death() -> None:
    pair = FakePair()
    watch = RaceWatch(pair)
    assert watch.revive() is False and pair.restarts == []
    pair.text["prefill"] += DEATH
    assert watch.revive() is True and pair.restarts == ["prefill"]
    assert watch.revive() is False and pair.restarts == ["prefill"]  # the same death, already revived
    pair.text["prefill"] += DEATH
    assert watch.revive() is True and pair.restarts == ["prefill", "prefill"]


def test_deaths_are_counted_in_a_runs_worker_logs(tmp_path: Path) -> None:
    assert deaths_in_run(tmp_path) == 0  # no logs directory at all
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "prefill.log").write_text("ok\n" + DEATH + DEATH)
    (logs / "decode.log").write_text("Decode transfer failed ... timed out after 20.0s in KVPoll.WaitingForInput\n")
    (logs / "router.log").write_text("")
    assert deaths_in_run(tmp_path) == 2
