"""`reproduce.yaml`: the exact campaign and seed that replay this run.

It is the validated campaign the run used (every default spelled out, so a later pdchaos with
different defaults still replays the same thing), with the run's seed pinned. The seed fixes
the random fault schedule and the load's choices; the header records what was resolved from it
and what the run ran against, for whoever compares the replay with the original.
"""

from __future__ import annotations

from typing import Any

import yaml

from reports.model import RunReport


def render_reproduce(report: RunReport) -> str:
    campaign = report.meta.get("campaign")
    header = [
        f"# Replays run {report.run_dir.name} of campaign {report.campaign_name} ({report.verdict_label}).",
        "#   pdchaos run reproduce.yaml",
        f"# Seed {report.seed}; the run's canary prefix was {report.meta.get('run_prefix', '?')} (fresh on every run).",
    ]
    engine = report.environment.get("engine")
    if isinstance(engine, dict):
        header.append(
            "# Engine: "
            + ", ".join(f"{role} {info.get('version')}" for role, info in engine.items() if isinstance(info, dict))
        )
    planned = report.meta.get("windows_planned")
    if isinstance(planned, list) and planned:
        header.append("# Fault schedule the seed resolved to:")
        header += [
            f"#   {w.get('fault')} at {w.get('at_s')}s for {w.get('duration_s')}s {w.get('params') or ''}".rstrip()
            for w in planned
            if isinstance(w, dict)
        ]
    if not isinstance(campaign, dict):
        campaign = _given_campaign(report.meta.get("campaign_yaml"))
        if campaign is None:
            return "\n".join(header + ["# The journal holds no campaign: this run cannot be replayed.", "{}"]) + "\n"
        header.append("# Only the campaign as given was journaled (defaults not spelled out).")
    pinned: dict[str, Any] = dict(campaign)
    if report.seed is not None:
        pinned["seed"] = report.seed
    return "\n".join(header) + "\n" + yaml.safe_dump(pinned, sort_keys=False, allow_unicode=True)


def _given_campaign(text: object) -> dict[str, Any] | None:
    if not isinstance(text, str):
        return None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        return None
    return data if isinstance(data, dict) else None
