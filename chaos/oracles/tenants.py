"""Tenant isolation of the prefix cache (bug class K9, docs/architecture.md; vLLM CVE-2025-46570).

The evidence is the tenant probe's records (`chaos/tenant_probe.py`: `user_kind ==
"tenant_probe"`, sent one at a time with no load). Each round, a victim tenant (salt A) sends a
fresh secret prefix plus a question (`actor == "victim"`) and sends it again (`"victim_repeat"`);
then an attacker tenant (salt B) sends the same prefix with its own question (`"attacker_guess"`)
and a never-sent prefix of the same length with the same question (`"attacker_control"`). The
victim's two records and the guess share the victim's request index (the guess carries the
victim's markers, so a reply that repeats them is not a leak); the control has its own.

Rules, over the usable records (status 200, outcome ok, a first token seen; TTFT =
`t_first_token - t_send`):

(b) Engine telemetry. Any attacker_guess that reports `cached_tokens > 0` is FAIL: the engine
    itself says it served another tenant's KV (less what the controls report: see the end).
(c) Timing side channel. Two-sample Kolmogorov-Smirnov test of guess TTFTs against control TTFTs
    (as in Gu et al., "Auditing Prompt Caching", arXiv 2502.07776), one-sided: H1 is "guesses are
    stochastically faster" (statistic D+ = sup(F_guess - F_control), Smirnov's asymptotic p =
    exp(-2 z^2), z = sqrt(nm/(n+m)) D+). p < alpha (0.01) with the guesses' median below the
    controls' by a practical margin is FAIL: another tenant's prompt is observable from the outside.
    The margin is a quarter of what a hit saves, measured by the positive control (victim first
    sends minus victim repeats, medians). Significance alone is not enough: with 12 rounds a
    systematic 0.3 ms drift between guesses and controls on a clean engine reached p = 0.005, while
    a real cross-tenant hit saves tens of ms. Nor is timing judged when same-tenant hits are not
    visible in TTFT: a cross-tenant hit cannot save more than a same-tenant one, so a gap there is
    noise. (A clean vLLM CPU pair, whose whole prefill takes 18 ms under 0.5 s of noisy two-hop
    overhead, once showed guesses 260 ms faster at p = 0.005.)
(a) Positive control (vLLM PR #53347's point: "different salt => no reuse" passes trivially when
    caching is off). Same-salt reuse is shown when at least half of the victim repeats that
    report `cached_tokens` report a hit, or when the repeats are significantly faster than the
    first sends (the same one-sided KS test). Otherwise INCONCLUSIVE: "prefix caching seems off:
    isolation cannot be shown".

Evidence of a leak wins: (b) FAILs even when (a) could not be shown; (c) needs (a) shown by
timing, as above. Without a FAIL:
no tenant records is INCONCLUSIVE ("tenant probe not run"); (a) not shown is INCONCLUSIVE; so is
a timing test that could not reach significance even at D+ = 1 (too few usable guesses or
controls). Otherwise PASS, with the KS statistics in the notes. When the positive control rests on
`cached_tokens` alone (same-tenant hits were not visible in TTFT either), the notes say that the
timing comparison had no power at this resolution. Every tenant prompt opens with the run's marker
prefix: a radix cache that matches single tokens (SGLang with page size 1) serves those few tokens
from the attacker's own earlier prompts, and its controls report them. Up to
`OWN_OPENING_MAX_TOKENS`, what the controls report is discounted from every guess; a control
reporting more (a prompt never sent before) makes the telemetry untrustworthy: INCONCLUSIVE finding,
and a guess then FAILs rule (b) only when it reports more than every control by
`OWN_OPENING_MAX_TOKENS` again (an engine that reports every prompt as cached, as vLLM's PD
connector did before vLLM PR #46898, reports guesses and controls alike).
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from chaos.journal import Outcome, RequestRecord
from chaos.oracles.base import OracleContext
from chaos.verdict import Finding, OracleResult, Verdict

TENANT_KIND = "tenant_probe"  # user_kind (and phase) of the tenant probe's records
VICTIM = "victim"
VICTIM_REPEAT = "victim_repeat"
ATTACKER_GUESS = "attacker_guess"
ATTACKER_CONTROL = "attacker_control"
ROLES = (VICTIM, VICTIM_REPEAT, ATTACKER_GUESS, ATTACKER_CONTROL)
DEFAULT_ALPHA = 0.01
HIT_SAVING_FRACTION = 0.25  # a side channel must show at least this share of a same-tenant hit's saving
OWN_OPENING_MAX_TOKENS = 16  # the most a control may share with the attacker's own earlier prompts


# ------------------------------------------------------------------- two-sample KS test ----


@dataclass(frozen=True)
class KSResult:
    """Two-sample Kolmogorov-Smirnov statistics of samples a (size n) and b (size m)."""

    n: int
    m: int
    d: float  # sup |F_a - F_b|
    d_plus: float  # sup (F_a - F_b): large when a tends to be smaller than b
    d_minus: float  # sup (F_b - F_a)
    p_two_sided: float  # H1: the distributions differ (Kolmogorov's asymptotic distribution)
    p_a_smaller: float  # H1: a is stochastically smaller (scipy's alternative="greater")

    @property
    def effective_n(self) -> float:
        return self.n * self.m / (self.n + self.m)

    def describe(self) -> str:
        return (
            f"KS n={self.n}, m={self.m}: D={self.d:.3f} (two-sided p={self.p_two_sided:.3g}), "
            f"D+={self.d_plus:.3f} (one-sided p={self.p_a_smaller:.3g})"
        )


def kolmogorov_sf(lam: float) -> float:
    """P(K > lam) for Kolmogorov's limiting distribution: 2 sum_{k>=1} (-1)^(k-1) exp(-2 k^2 lam^2).

    For small lam that series converges slowly; there the equivalent theta-function form
    P(K <= lam) = sqrt(2 pi) / lam * sum_{k>=1} exp(-(2k-1)^2 pi^2 / (8 lam^2)) is used.
    """
    if not lam > 0:
        return 1.0
    if lam < 1.18:
        total = 0.0
        for k in range(1, 50):
            term = math.exp(-((2 * k - 1) ** 2) * math.pi**2 / (8 * lam * lam))
            total += term
            if term < 1e-17 * total:
                break
        return min(1.0, max(0.0, 1.0 - math.sqrt(2 * math.pi) / lam * total))
    total = 0.0
    for k in range(1, 101):
        term = math.exp(-2 * k * k * lam * lam)
        total += term if k % 2 else -term
        if term < 1e-17:
            break
    return min(1.0, max(0.0, 2.0 * total))


def smirnov_one_sided_sf(z: float) -> float:
    """P(sqrt(nm/(n+m)) D+ > z), Smirnov's asymptotic limit exp(-2 z^2) (conservative for small samples)."""
    if not z > 0:
        return 1.0
    return min(1.0, math.exp(-2.0 * z * z))


def ks_two_sample(a: Sequence[float], b: Sequence[float]) -> KSResult:
    """Both KS statistics and their asymptotic p-values; ties are handled (right-continuous CDFs)."""
    x = np.sort(np.asarray(a, dtype=float))
    y = np.sort(np.asarray(b, dtype=float))
    n, m = len(x), len(y)
    if n == 0 or m == 0:
        raise ValueError("the KS test needs two non-empty samples")
    grid = np.concatenate([x, y])
    fa = np.searchsorted(x, grid, side="right") / n
    fb = np.searchsorted(y, grid, side="right") / m
    diff = fa - fb
    d_plus = max(0.0, float(diff.max()))
    d_minus = max(0.0, float(-diff.min()))
    d = max(d_plus, d_minus)
    root = math.sqrt(n * m / (n + m))
    return KSResult(
        n=n,
        m=m,
        d=d,
        d_plus=d_plus,
        d_minus=d_minus,
        p_two_sided=kolmogorov_sf(root * d),
        p_a_smaller=smirnov_one_sided_sf(root * d_plus),
    )


def best_possible_p(n: int, m: int) -> float:
    """The smallest one-sided p two samples of these sizes can give (D+ = 1)."""
    return smirnov_one_sided_sf(math.sqrt(n * m / (n + m))) if n and m else 1.0


# ---------------------------------------------------------------------------- the oracle ----


def ttft(record: RequestRecord) -> float | None:
    """The exact time to first token of a usable record (200, ok, a first token seen), else None."""
    if record.status != 200 or record.outcome is not Outcome.OK:
        return None
    if record.t_send is None or record.t_first_token is None:
        return None
    return record.t_first_token - record.t_send


def _ms(values: Sequence[float]) -> str:
    return f"{statistics.median(values) * 1000:.1f} ms" if values else "n/a"


def _first(labels: list[str]) -> str | None:
    return labels[0] if labels else None


@dataclass
class _Faster:
    """Is sample a significantly faster than sample b? (one-sided KS, direction checked)"""

    ks: KSResult | None
    significant: bool
    possible: bool  # could these sample sizes reach significance at all?


def _faster(a: list[float], b: list[float], alpha: float) -> _Faster:
    if not a or not b:
        return _Faster(None, False, False)
    ks = ks_two_sample(a, b)
    significant = ks.p_a_smaller < alpha and statistics.median(a) < statistics.median(b)
    return _Faster(ks, significant, best_possible_p(len(a), len(b)) < alpha)


def _median_gap(faster: list[float], slower: list[float]) -> float:
    return statistics.median(slower) - statistics.median(faster) if faster and slower else 0.0


class TenantIsolationOracle:
    name = "tenant_isolation"

    def __init__(self, *, alpha: float = DEFAULT_ALPHA) -> None:
        if not 0 < alpha < 1:
            raise ValueError("alpha must be in (0, 1)")
        self.alpha = alpha

    def evaluate(self, ctx: OracleContext) -> OracleResult:
        records = [r for r in ctx.requests if r.user_kind == TENANT_KIND]
        if not records:
            return OracleResult(self.name, Verdict.INCONCLUSIVE, 0, [], ["tenant probe not run"])
        by_role: dict[str, list[RequestRecord]] = {role: [] for role in ROLES}
        unknown: Counter[str] = Counter()
        for record in records:
            if record.actor in by_role:
                by_role[record.actor].append(record)
            else:
                unknown[record.actor or "(none)"] += 1
        times = {role: [t for r in rs if (t := ttft(r)) is not None] for role, rs in by_role.items()}
        notes = [
            f"{role}: {len(by_role[role])} record(s), {len(times[role])} with a TTFT (median {_ms(times[role])})"
            for role in ROLES
        ]
        notes += [
            f"{count} tenant record(s) with an unknown role {actor!r} ignored" for actor, count in unknown.items()
        ]
        findings: list[Finding] = []

        # (b) the engine's own telemetry: a cross-tenant cache hit. The attacker's own opening (the
        # run's marker prefix, which every tenant prompt starts with) is cached under its own salt
        # by a token-granular radix cache: what its never-sent controls report, up to
        # OWN_OPENING_MAX_TOKENS, is not the victim's.
        # Controls reporting more than that (prompts never sent before) make the telemetry
        # untrustworthy (vLLM's PD connector reported the whole prompt as cached before PR #46898):
        # a guess is then a hit only when it reports more than every control by as much again.
        victims = {r.request_index: r for r in by_role[VICTIM]}
        control_hits = [r.cached_tokens for r in by_role[ATTACKER_CONTROL] if r.status == 200 and r.cached_tokens]
        most = max(control_hits, default=0)
        trusted = most <= OWN_OPENING_MAX_TOKENS
        own = most if trusted else most + OWN_OPENING_MAX_TOKENS
        if most:
            notes.append(
                f"the attacker's controls report up to {most} cached token(s): its own opening, "
                f"discounted from every guess"
                if trusted
                else f"the attacker's controls report up to {most} cached token(s) for prompts never sent: a guess "
                f"counts as a hit only above {own}"
            )
        for guess in by_role[ATTACKER_GUESS]:
            if guess.status == 200 and guess.cached_tokens and guess.cached_tokens > own:
                victim = victims.get(guess.request_index)
                faults = ctx.windows_at(guess.t_send)
                findings.append(
                    Finding(
                        self.name,
                        Verdict.FAIL,
                        f"cross-tenant cache hit: {guess.id} (attacker salt) reused {guess.cached_tokens} cached token(s) of "
                        f"a prefix only the victim tenant had sent" + (f" ({victim.id})" if victim else ""),
                        request_id=guess.id,
                        victim_request_id=victim.id if victim else None,
                        window=_first(faults),
                        evidence={
                            "cached_tokens": guess.cached_tokens,
                            "controls_cached_tokens_max": most,
                            "prompt_tokens": guess.prompt_tokens,
                            "ttft_s": ttft(guess),
                            "faults_active": faults,
                        },
                    )
                )
        bogus = [
            r for r in by_role[ATTACKER_CONTROL] if r.status == 200 and (r.cached_tokens or 0) > OWN_OPENING_MAX_TOKENS
        ]
        if bogus:
            findings.append(
                Finding(
                    self.name,
                    Verdict.INCONCLUSIVE,
                    f"{len(bogus)} control prompt(s) never sent before report cached tokens (e.g. {bogus[0].id}: "
                    f"{bogus[0].cached_tokens}): the cached_tokens telemetry cannot tell a cross-tenant hit apart",
                    request_id=bogus[0].id,
                    evidence={"cached_tokens": [r.cached_tokens for r in bogus]},
                )
            )

        # (c) the timing side channel: guesses against never-sent controls.
        # Judged only when same-tenant hits show in TTFT: what they save bounds what a cross-tenant
        # hit can save, and sets the margin.
        side = _faster(times[ATTACKER_GUESS], times[ATTACKER_CONTROL], self.alpha)
        same = _faster(times[VICTIM_REPEAT], times[VICTIM], self.alpha)
        margin = HIT_SAVING_FRACTION * _median_gap(times[VICTIM_REPEAT], times[VICTIM])
        gap = _median_gap(times[ATTACKER_GUESS], times[ATTACKER_CONTROL])
        if side.ks is not None:
            notes.append(
                f"attacker guesses vs controls: {side.ks.describe()}, median gap {gap * 1000:.1f} ms; FAIL when "
                f"the one-sided p < {self.alpha:g} and the guesses are faster by at least {margin * 1000:.1f} ms"
                + ("" if same.significant else " (not judged: same-tenant hits were not visible in TTFT)")
            )
        if side.significant and not same.significant:
            notes.append(
                f"guesses were significantly ({gap * 1000:.1f} ms) faster than controls, but same-tenant hits "
                f"were not visible in TTFT: a cross-tenant hit cannot save more than a same-tenant one, so this "
                f"is noise, not a cache hit"
            )
        elif side.significant and gap < margin:
            notes.append(
                f"guesses were significantly but only {gap * 1000:.1f} ms faster than controls (the margin is "
                f"{margin * 1000:.1f} ms): drift, not a cache hit"
            )
        elif side.significant:
            assert side.ks is not None
            findings.append(
                Finding(
                    self.name,
                    Verdict.FAIL,
                    f"timing side channel: another tenant's prompt is observable: attacker guesses of the victim's prefix "
                    f"got their first token in {_ms(times[ATTACKER_GUESS])} (median) vs {_ms(times[ATTACKER_CONTROL])} for "
                    f"never-sent controls of the same length (KS D+={side.ks.d_plus:.3f}, p={side.ks.p_a_smaller:.3g})",
                    evidence={
                        "d": side.ks.d,
                        "d_plus": side.ks.d_plus,
                        "p_one_sided": side.ks.p_a_smaller,
                        "p_two_sided": side.ks.p_two_sided,
                        "n_guess": side.ks.n,
                        "n_control": side.ks.m,
                        "median_gap_s": round(gap, 6),
                        "margin_s": round(margin, 6),
                        "guess_ttft_s": [round(t, 6) for t in times[ATTACKER_GUESS]],
                        "control_ttft_s": [round(t, 6) for t in times[ATTACKER_CONTROL]],
                    },
                )
            )

        # (a) the positive control: same-salt reuse must work, or nothing above proves isolation.
        repeats = [r for r in by_role[VICTIM_REPEAT] if r.status == 200]
        reported = [r for r in repeats if r.cached_tokens is not None]
        hits = [r for r in reported if r.cached_tokens]
        telemetry_reuse = bool(reported) and 2 * len(hits) >= len(reported)
        notes.append(
            f"same-tenant reuse: {len(hits)} of {len(reported)} victim repeat(s) reporting cached_tokens hit "
            f"the cache" + (f"; repeats vs first sends: {same.ks.describe()}" if same.ks else "")
        )
        if not telemetry_reuse and not same.significant:
            findings.append(
                Finding(
                    self.name,
                    Verdict.INCONCLUSIVE,
                    "prefix caching seems off: isolation cannot be shown (the victim's same-salt repeats showed no cache "
                    f"reuse: {len(hits)} of {len(reported)} reported cached tokens, TTFT {_ms(times[VICTIM_REPEAT])} vs "
                    f"{_ms(times[VICTIM])} on first send)",
                    evidence={
                        "repeats": len(repeats),
                        "reported": len(reported),
                        "hits": len(hits),
                        "p_repeat_faster": same.ks.p_a_smaller if same.ks else None,
                    },
                )
            )
        elif not same.significant:
            notes.append(
                "same-tenant cache hits were not visible in TTFT either: the timing comparison had no power "
                "at this resolution; isolation rests on the cached_tokens telemetry"
            )
        if not any(r.cached_tokens is not None for r in by_role[ATTACKER_GUESS]):
            notes.append("no attacker guess reported cached_tokens: rule (b) could not be checked")
        if not side.possible:
            findings.append(
                Finding(
                    self.name,
                    Verdict.INCONCLUSIVE,
                    f"too few usable attacker records for the timing test ({len(times[ATTACKER_GUESS])} guess(es), "
                    f"{len(times[ATTACKER_CONTROL])} control(s)): even a complete separation would not reach p < {self.alpha:g}",
                )
            )
        checked = len({r.request_index for r in by_role[ATTACKER_GUESS] if r.status == 200})
        return OracleResult.from_findings(self.name, checked, findings, notes)
