"""The run journal: round-trips, WAL, batching, crash durability and concurrent readers."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from chaos.journal import (
    JOURNAL_FILENAME,
    REQUEST_COLUMNS,
    EventKind,
    Journal,
    JournalError,
    JournalEvent,
    Outcome,
    RequestRecord,
)

REPO_ROOT = Path(__file__).resolve().parents[1]


def full_record(index: int) -> RequestRecord:
    return RequestRecord(
        id=f"req-{index}",
        request_index=index,
        phase="load",
        user_kind="chat",
        actor="load-0",
        endpoint="/v1/chat/completions",
        stream=True,
        markers=[f"UULK7QX{index:06d}0ABC", f"UULK7QX{index:06d}1ABC"],
        prompt="Repeat after me: ñ and 日本",  # not ASCII: the journal keeps text as is
        max_tokens=64,
        planned_send=1000.0 + index,
        t_send=1000.25 + index,
        t_first_byte=1000.5 + index,
        t_first_token=1000.75 + index,
        t_end=1001.0 + index,
        token_times=[1000.75 + index, 1000.8 + index],
        status=200,
        finish_reason="stop",
        prompt_tokens=12,
        completion_tokens=2,
        cached_tokens=4,
        response_text="hello world",
        body_bytes=321,
        outcome=Outcome.OK,
        anomaly=None,
    )


def wait_until(predicate, timeout_s: float = 5.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return bool(predicate())


def test_requests_events_and_meta_round_trip(tmp_path: Path) -> None:
    records = [full_record(i) for i in range(5)]
    records.append(RequestRecord(id="req-aborted", request_index=99, outcome="info", error_class="ReadTimeout"))
    with Journal.create(tmp_path / "run") as journal:
        journal.append_requests(records)
        fault = journal.append_event(JournalEvent(kind=EventKind.FAULT, name="stall_prefill", data={"pid": 42}, t=5.0))
        heal = journal.append_event(JournalEvent(kind="heal", name="stall_prefill"))
        journal.set_meta("campaign", {"name": "default", "seed": 7})
        journal.set_meta("seed", 7)
        journal.set_meta("seed", 8)  # meta keeps the latest value

    assert (fault.seq, fault.kind) == (1, "fault")
    assert heal.seq == 2
    with Journal.open(tmp_path / "run", readonly=True) as reader:
        assert list(reader.iter_requests()) == records
        assert reader.get_request("req-aborted") == records[-1]
        assert reader.get_request("missing") is None
        assert records[-1].prompt_chars == 0 and records[0].prompt_chars == len(records[0].prompt)
        events = list(reader.iter_events())
        assert [(e.seq, e.kind, e.name) for e in events] == [
            (1, "fault", "stall_prefill"),
            (2, "heal", "stall_prefill"),
        ]
        assert events[0].data == {"pid": 42} and events[0].t == 5.0
        assert reader.get_meta("campaign") == {"name": "default", "seed": 7}
        assert reader.get_meta("seed") == 8
        assert reader.get_meta("absent", "dflt") == "dflt"
        assert reader.all_meta() == {"campaign": {"name": "default", "seed": 7}, "seed": 8}


def test_filters_paging_and_counts(tmp_path: Path) -> None:
    with Journal.create(tmp_path) as journal:
        for i in range(20):
            outcome = (Outcome.OK, Outcome.FAIL, Outcome.INFO)[i % 3]
            journal.append_request(RequestRecord(id=f"r{i}", request_index=i, outcome=outcome, phase=f"p{i % 2}"))
        for i in range(10):
            journal.append_event(JournalEvent(kind="probe" if i % 2 else "phase", name=f"e{i}"))

        assert [r.request_index for r in journal.iter_requests(batch_size=7)] == list(range(20))
        assert journal.count_requests() == 20
        assert journal.count_requests(outcome="fail") == 7
        ok = [r.request_index for r in journal.iter_requests(outcome=Outcome.OK, batch_size=2)]
        assert ok == [0, 3, 6, 9, 12, 15, 18]
        assert [r.id for r in journal.iter_requests(phase="p1", outcome="info")] == [
            "r5",
            "r11",
            "r17",
        ]
        probes = [e.name for e in journal.iter_events(kind=EventKind.PROBE, batch_size=2)]
        assert probes == ["e1", "e3", "e5", "e7", "e9"]
        assert [e.seq for e in journal.iter_events(after_seq=8)] == [9, 10]
        assert [e.name for e in journal.iter_events(name="e4")] == ["e4"]


def test_file_is_in_wal_mode_with_the_declared_schema(tmp_path: Path) -> None:
    Journal.create(tmp_path).close()
    conn = sqlite3.connect(tmp_path / JOURNAL_FILENAME)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        columns = tuple(row[1] for row in conn.execute("PRAGMA table_info(requests)"))
        assert columns == REQUEST_COLUMNS
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        assert {"requests", "events", "meta"} <= tables
    finally:
        conn.close()


def test_outcome_is_restricted_to_ok_fail_info(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        RequestRecord(id="x", request_index=0, outcome="maybe")
    Journal.create(tmp_path).close()
    conn = sqlite3.connect(tmp_path / JOURNAL_FILENAME)
    try:
        with pytest.raises(sqlite3.IntegrityError):
            conn.execute(
                "INSERT INTO requests (id, request_index, user_kind, actor, endpoint, stream,"
                " markers, prompt, prompt_chars, token_times, response_text, outcome)"
                " VALUES ('x', 0, '', '', '', 0, '[]', '', 0, '[]', '', 'maybe')"
            )
    finally:
        conn.close()


def test_appends_are_batched_by_count_and_by_time(tmp_path: Path) -> None:
    writer = Journal.create(tmp_path, flush_every=3, flush_interval_s=60.0)
    reader = Journal.open(tmp_path, readonly=True)
    try:
        writer.append_request(RequestRecord(id="a", request_index=0))
        writer.append_request(RequestRecord(id="b", request_index=1))
        assert reader.count_requests() == 0  # still buffered
        writer.append_request(RequestRecord(id="c", request_index=2))
        assert reader.count_requests() == 3  # the third filled the batch
        writer.append_request(RequestRecord(id="d", request_index=3))
        writer.flush()
        assert reader.count_requests() == 4
    finally:
        writer.close()
        reader.close()

    timed = Journal.open(tmp_path, flush_every=10_000, flush_interval_s=0.1)
    reader = Journal.open(tmp_path, readonly=True)
    try:
        timed.append_request(RequestRecord(id="e", request_index=4))
        started = time.monotonic()
        assert wait_until(lambda: reader.count_requests() == 5, timeout_s=1.0)
        assert time.monotonic() - started < 1.0
    finally:
        timed.close()
        reader.close()


def test_events_commit_at_once_after_buffered_requests(tmp_path: Path) -> None:
    writer = Journal.create(tmp_path, flush_every=10_000, flush_interval_s=60.0)
    reader = Journal.open(tmp_path, readonly=True)
    try:
        writer.append_request(RequestRecord(id="a", request_index=0))
        writer.append_event(JournalEvent(kind="fault", name="plan", data={"undo": "SIGCONT 42"}))
        assert [e.data for e in reader.iter_events()] == [{"undo": "SIGCONT 42"}]
        assert reader.count_requests() == 1
    finally:
        writer.close()
        reader.close()


def test_duplicate_ids_do_not_lose_the_rest_of_the_batch(tmp_path: Path) -> None:
    with Journal.create(tmp_path, flush_every=10_000) as journal:
        journal.append_requests(
            [
                RequestRecord(id="a", request_index=0),
                RequestRecord(id="a", request_index=1, response_text="second"),
                RequestRecord(id="b", request_index=2),
            ]
        )
        journal.flush()
        assert [r.request_index for r in journal.iter_requests()] == [0, 2]
        (rejected,) = journal.iter_events(kind=EventKind.NOTE, name="rejected_request")
        assert rejected.data["record"]["response_text"] == "second"


def test_read_only_and_closed_journals_refuse_writes(tmp_path: Path) -> None:
    journal = Journal.create(tmp_path)
    reader = Journal.open(tmp_path, readonly=True)
    with pytest.raises(JournalError, match="read-only"):
        reader.append_request(RequestRecord(id="a", request_index=0))
    with pytest.raises(JournalError, match="read-only"):
        reader.set_meta("k", 1)
    reader.close()
    journal.close()
    journal.close()  # twice is fine
    with pytest.raises(JournalError, match="closed"):
        journal.append_request(RequestRecord(id="a", request_index=0))


def test_open_and_create_check_the_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        Journal.open(tmp_path / "nowhere")
    Journal.create(tmp_path).close()
    with pytest.raises(FileExistsError):
        Journal.create(tmp_path)
    conn = sqlite3.connect(tmp_path / JOURNAL_FILENAME)
    conn.execute("PRAGMA user_version = 99")
    conn.close()
    with pytest.raises(JournalError, match="schema version 99"):
        Journal.open(tmp_path)


CRASHING_WRITER = textwrap.dedent(
    """
    import sys, time
    from chaos.journal import Journal, JournalEvent, RequestRecord

    journal = Journal.create(sys.argv[1], flush_every=100_000, flush_interval_s=0.5)
    journal.set_meta("seed", 7)
    for i in range(500):
        journal.append_request(RequestRecord(id=f"r{i}", request_index=i, response_text="x" * 100))
    journal.flush()
    print("flushed 500", flush=True)
    journal.append_event(JournalEvent(kind="fault", name="stall", data={"undo": "SIGCONT"}))
    for i in range(500, 700):
        journal.append_request(RequestRecord(id=f"r{i}", request_index=i))
    print("appended 700", flush=True)  # not flushed by hand: the background flush must do it
    time.sleep(60)
    """
)


def test_sigkill_leaves_a_readable_journal_with_everything_committed(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    child = subprocess.Popen(
        [sys.executable, "-c", CRASHING_WRITER, str(run_dir)],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "flushed 500"
        with Journal.open(run_dir, readonly=True) as live:
            assert live.count_requests() >= 500  # readable while the writer is alive
        assert child.stdout.readline().strip() == "appended 700"
        time.sleep(1.2)  # records must be committed within a second, with no help
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(timeout=10) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()

    with Journal.open(run_dir, readonly=True) as journal:
        assert journal.count_requests() == 700
        assert [r.request_index for r in journal.iter_requests()] == list(range(700))
        assert [(e.kind, e.data) for e in journal.iter_events()] == [("fault", {"undo": "SIGCONT"})]
        assert journal.get_meta("seed") == 7
    with Journal.open(run_dir) as resumed:  # e.g. `pdchaos heal RUN_DIR` appending after a crash
        resumed.append_event(JournalEvent(kind="heal", name="stall"))
        assert resumed.count_requests() == 700


def test_readers_see_a_growing_journal_while_a_writer_appends(tmp_path: Path) -> None:
    total = 3000
    writer = Journal.create(tmp_path, flush_every=50, flush_interval_s=0.05)
    errors: list[BaseException] = []

    def write() -> None:
        try:
            for i in range(total):
                writer.append_request(RequestRecord(id=f"r{i}", request_index=i))
                if i % 100 == 0:
                    writer.append_event(JournalEvent(kind="phase", name=f"tick{i}"))
                    time.sleep(0.005)
            writer.flush()
        except BaseException as error:  # surfaced by the assertion below
            errors.append(error)

    thread = threading.Thread(target=write)
    thread.start()
    seen: list[int] = []
    with Journal.open(tmp_path, readonly=True) as reader:
        while True:
            finished = not thread.is_alive()  # read once more after the writer's last flush
            count = reader.count_requests()
            indices = [r.request_index for r in reader.iter_requests(batch_size=500)]
            assert indices == list(range(len(indices))), "a reader sees a prefix, in order"
            assert len(indices) >= count
            seen.append(count)
            if finished:
                break
    thread.join()
    writer.close()
    assert errors == []
    assert seen == sorted(seen), "a reader never sees the journal shrink"
    assert seen[-1] == total
    assert len(set(seen)) > 2, "the reader should have seen intermediate states"
