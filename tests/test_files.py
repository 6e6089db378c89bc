"""`replace_file`: a reader never sees a state file half-written.

`pdchaos heal` reads `target.json` after the driver was SIGKILLed, perhaps in the middle of
rewriting it (a fault that restarts a worker rewrites it); a plain `write_text` truncates first,
so a kill or a read at that moment finds an empty file.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

from chaos.files import replace_file

BODY = json.dumps({"processes": [{"name": f"worker-{i}", "pgid": 10_000 + i} for i in range(2_000)]})


def _torn_reads(path: Path, write: Callable[[Path, str], None], give_up_after_s: float) -> int:
    """Rewrite `path` while a thread reads it; how many reads found something that is not the body."""
    write(path, BODY)
    stop = threading.Event()
    torn = 0

    def read() -> None:
        nonlocal torn
        while not stop.is_set():
            if path.read_text() != BODY:
                torn += 1

    reader = threading.Thread(target=read)
    reader.start()
    deadline = time.monotonic() + give_up_after_s
    try:
        while time.monotonic() < deadline and not torn:
            write(path, BODY)
    finally:
        stop.set()
        reader.join()
    return torn


def test_a_reader_never_sees_a_file_being_replaced_half_written(tmp_path: Path) -> None:
    assert _torn_reads(tmp_path / "target.json", replace_file, give_up_after_s=3) == 0


def test_the_check_sees_a_plain_rewrite_torn(tmp_path: Path) -> None:
    """The same check catches the write this replaced, so the test above can fail."""
    assert _torn_reads(tmp_path / "target.json", lambda p, t: p.write_text(t), give_up_after_s=30) > 0
