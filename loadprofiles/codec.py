"""The run's marker codec as a Locust process holds it: one that remembers the markers it made last.

A canary prompt asks for its two markers twice (loadprofiles/prompts.py: once for its text, once
for the `Prompt`), and each costs a keyed hash: about a quarter of building the prompt. The users
run as greenlets, which switch only on I/O, so a prompt is built whole before another user asks for
markers; a few remembered entries catch every second ask.
"""

from __future__ import annotations

from chaos.markers import MarkerCodec


class RecentMarkers(MarkerCodec):
    KEEP = 16  # entries; a prompt needs two

    def __init__(self, run_prefix: str) -> None:
        super().__init__(run_prefix)
        self._recent: dict[tuple[int, int], str] = {}

    def marker(self, request_index: int, slot: int = 0) -> str:
        key = (request_index, slot)
        made = self._recent.get(key)
        if made is None:
            if len(self._recent) >= self.KEEP:
                self._recent.clear()
            made = self._recent[key] = super().marker(request_index, slot)
        return made
