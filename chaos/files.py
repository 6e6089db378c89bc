"""Files another process may read at any moment, or after the writer was killed."""

from __future__ import annotations

import os
from pathlib import Path


def replace_file(path: Path, text: str) -> None:
    """Write `text` to `path` whole or not at all: a reader, or `pdchaos heal` after the writer was
    SIGKILLed mid-write, sees the old file or the new one, never an empty or half-written one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
