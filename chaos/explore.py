"""`pdchaos run CAMPAIGN --explore N`: search for what no fixed schedule anticipated.

A campaign's schedule is a guess about which faults, in which order, expose a bug. Exploration
draws N seeded random schedules from the campaign's own fault windows (each keeps its params; the
order, the count and the durations are drawn), runs each as a whole qualification run, and stops
at the first FAIL. Then it shrinks the failing schedule the way property-based testing and Jepsen
report a counterexample: drop one window at a time, then shorten the load, keeping each step only
while the run still FAILs. The result is run once more, and where it does not FAIL again (a
timing-dependent bug can FAIL one step by luck) the steps are walked back until one does. What is
left is written as `RUN_DIR/reproduce.yaml`, a campaign that `pdchaos run` takes as it is;
`RUN_DIR/explore.json` lists every attempt and its verdict.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from chaos.campaign import Campaign
from chaos.campaign_validation import parse_campaign
from chaos.verdict import Verdict

GAP_S = 6.0  # quiet time between windows: aftershock probes and the provocation's after-heal waves
LEAD_S = 3.0  # the first window opens this long after the load starts
TAIL_S = 10.0  # the load runs on this long after the last window
MIN_WINDOWS, MAX_WINDOWS = 2, 6
DURATION_SCALE = (
    1.0,
    1.6,
)  # a drawn window lasts its original duration times this (never shorter: a stall must outlast the timeout)


@dataclass
class Attempt:
    label: str  # "explore 3", "shrink: without w2 (kv_transfer)", ...
    run_dir: str
    verdict: str
    windows: list[str] = field(default_factory=list)
    load_s: float = 0.0


Run = Callable[[Campaign, Path], Verdict]


def draw_schedule(campaign: Campaign, k: int) -> Campaign:
    """The k-th random schedule: windows drawn from the campaign's own, back to back."""
    rng = random.Random(f"{campaign.seed}:{k}")
    pool = campaign.windows()
    if not pool:
        raise ValueError("the campaign has no fault windows to draw from")
    count = rng.randint(min(MIN_WINDOWS, len(pool)), min(MAX_WINDOWS, max(MIN_WINDOWS, len(pool))))
    t, windows = LEAD_S, []
    for _ in range(count):
        source = rng.choice(pool)
        duration = round(max(1.0, source.duration_s * rng.uniform(*DURATION_SCALE)), 1)
        windows.append(
            {"fault": source.fault, "at": f"{t:g}s", "duration": f"{duration:g}s", "params": dict(source.params)}
        )
        t += duration + GAP_S
    return _with_schedule(campaign, windows, seed=campaign.seed + k, name=f"{campaign.name}-explore-{k}")


def _with_schedule(
    campaign: Campaign, windows: list[dict[str, Any]], seed: int, name: str, load_s: float | None = None
) -> Campaign:
    """The campaign with these windows and a steady load that outlasts them (stages are tied to
    the original schedule's times, so they go)."""
    data = campaign.model_dump(mode="json")
    last_end = max((_secs(w["at"]) + _secs(w["duration"]) for w in windows), default=0.0)
    data["name"], data["seed"] = name, seed
    data["faults"] = {"windows": windows}
    load = data["load"]
    load["shape"], load["stages"] = "steady", []
    load["duration"] = f"{load_s if load_s is not None else last_end + TAIL_S:g}s"
    return parse_campaign(data, name)


def _secs(value: Any) -> float:
    return float(str(value).rstrip("s"))


def _describe(campaign: Campaign) -> list[str]:
    return [f"{w.fault} at {w.at_s:g}s for {w.duration_s:g}s" for w in campaign.windows()]


def explore(
    campaign: Campaign, n: int, out: Path, run: Run, say: Callable[[str], None] = print
) -> tuple[Verdict, Path | None]:
    """Run up to `n` drawn schedules; shrink the first that FAILs. Returns (verdict, reproduce.yaml)."""
    out.mkdir(parents=True, exist_ok=True)
    attempts: list[Attempt] = []

    def attempt(label: str, candidate: Campaign, run_dir: Path) -> Verdict:
        say(f"{label}: {'; '.join(_describe(candidate))} (load {candidate.load.duration_s:g}s)")
        verdict = run(candidate, run_dir)
        attempts.append(Attempt(label, str(run_dir), verdict.value, _describe(candidate), candidate.load.duration_s))
        _write_log(out, attempts)
        say(f"{label}: {verdict.value}")
        return verdict

    failing: Campaign | None = None
    for k in range(1, n + 1):
        candidate = draw_schedule(campaign, k)
        if attempt(f"explore {k}/{n}", candidate, out / f"explore-{k}") is Verdict.FAIL:
            failing = candidate
            break
    if failing is None:
        say(f"no FAIL in {n} drawn schedule(s)")
        return (Verdict.PASS if all(a.verdict == "PASS" for a in attempts) else Verdict.INCONCLUSIVE), None
    minimal, again = confirmed(shrink_steps(failing, out, attempt), out, attempt)
    path = out / "reproduce.yaml"
    data = minimal.model_dump(mode="json")
    data["name"] = f"{campaign.name}-counterexample"
    header = (
        "# A counterexample found by `pdchaos run --explore` and shrunk: every window and second of load\n"
        "# left is needed for the FAIL (each removal was tried). It "
        + (
            "failed again when re-run"
            if again
            else "did NOT fail again when re-run: the failure depends on timing, run it several times"
        )
        + f".\n# Run it: pdchaos run {path.name}\n"
    )
    path.write_text(header + yaml.safe_dump(data, sort_keys=False))
    say(f"counterexample: {'; '.join(_describe(minimal))} (load {minimal.load.duration_s:g}s) -> {path}")
    return Verdict.FAIL, path


def confirmed(
    steps: list[Campaign], out: Path, attempt: Callable[[str, Campaign, Path], Verdict]
) -> tuple[Campaign, bool]:
    """The most shrunk schedule that FAILs once more, walking back through the shrink's steps: a
    timing-dependent bug can FAIL a step once by luck, and a counterexample is only worth its
    file if it fails again. (The last step, False) when none does."""
    for back, candidate in enumerate(reversed(steps)):
        label = (
            "confirm: the shrunk schedule once more"
            if back == 0
            else f"confirm: the shrink's step {len(steps) - 1 - back} once more"
        )
        if attempt(label, candidate, out / ("confirm" if back == 0 else f"confirm-{back}")) is Verdict.FAIL:
            return candidate, True
    return steps[-1], False


def shrink(failing: Campaign, out: Path, attempt: Callable[[str, Campaign, Path], Verdict]) -> Campaign:
    """Drop windows one at a time (the rest moved up), then cut the load's tail, while the run
    still FAILs."""
    return shrink_steps(failing, out, attempt)[-1]


def shrink_steps(failing: Campaign, out: Path, attempt: Callable[[str, Campaign, Path], Verdict]) -> list[Campaign]:
    """`shrink`, with every schedule it kept on the way: the failing one first, the smallest last."""
    current = failing
    kept = [failing]
    step = 0
    i = 0
    while len(current.windows()) > 1 and i < len(current.windows()):
        windows = [_window_dict(w) for w in current.windows()]
        dropped = windows.pop(i)
        candidate = _with_schedule(current, _respaced(windows), current.seed, current.name)
        step += 1
        if attempt(f"shrink {step}: without {dropped['fault']}", candidate, out / f"shrink-{step}") is Verdict.FAIL:
            current = candidate  # the same index now names the next window
            kept.append(current)
        else:
            i += 1
    windows = [_window_dict(w) for w in current.windows()]
    last_end = max(_secs(w["at"]) + _secs(w["duration"]) for w in windows) if windows else 0.0
    shorter = max(last_end + TAIL_S / 2, current.load.duration_s / 2)  # a window starts late, never early
    if shorter < current.load.duration_s:
        candidate = _with_schedule(current, windows, current.seed, current.name, load_s=round(shorter, 1))
        step += 1
        if attempt(f"shrink {step}: load {shorter:g}s", candidate, out / f"shrink-{step}") is Verdict.FAIL:
            kept.append(candidate)
    return kept


def _window_dict(window: Any) -> dict[str, Any]:
    return {
        "fault": window.fault,
        "at": f"{window.at_s:g}s",
        "duration": f"{window.duration_s:g}s",
        "params": dict(window.params),
    }


def _respaced(windows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Back to back again after a removal, so the load need not wait through the gap it left."""
    t, out = LEAD_S, []
    for w in windows:
        out.append({**w, "at": f"{t:g}s"})
        t += _secs(w["duration"]) + GAP_S
    return out


def _write_log(out: Path, attempts: list[Attempt]) -> None:
    (out / "explore.json").write_text(json.dumps([asdict(a) for a in attempts], indent=2))
