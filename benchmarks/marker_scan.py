"""Marker scan throughput: `MarkerCodec.scan` against a naive per-marker substring search.

The leak oracle (`chaos/oracles/leaks.py`) calls `MarkerCodec.scan` once on every recorded
response. The scan is two compiled regular expressions that know nothing about which markers
are in flight, so its cost depends on the hits it decodes (see below for what a codec
remembers), not on how many markers there are. The naive alternative loops over every marker
in flight and searches for it (`for m in in_flight: text.find(m)`); its cost grows with the
number of markers. This script measures both, in MB of response text per second, with 10,
10,000 and 1,000,000 markers in flight.

The corpus is model-like response text (prose, code, upper-case IDs and hex), about
`--mb` MB in responses of 200 to 6,000 characters. Half the responses repeat their prompt's
two markers, some carry a page-cut fragment of another request's marker, a few a marker of
another run. The embedded markers are drawn from the markers in flight, so each count gets its
own corpus, built from the same seed: the same texts with different request numbers in the
markers. A marker in flight is `codec.marker(i, slot)` for request i < N/2 and slot 0 or 1.

Two granularities:
- per response: one call per response, as the oracle does it (the main figure);
- joined: the whole corpus as one string (no per-call overhead; the most favourable case for
  the naive search, which then cannot tell which response a hit is in without a bisect).

The naive search finds only whole markers of this run; the scan also finds fragments and other
runs' markers, so it does more. For large counts the naive search is too slow to run in full:
it is timed on a random sample of the markers in flight (sized to take about `--naive-budget`
seconds per repetition) and extrapolated linearly, cost x N / sample. The output says when.
Within one repetition the scan, the marker-free pass (below) and the naive search take turns
going first, and the table gives medians over `--reps` repetitions. Before timing, it checks
that both methods find the same whole markers on the sampled markers.

The marker-free pass: the same generator's prose with no markers at all, scanned the same way.
It is what the scan costs when no hit needs any work, so `scan_over_clean` (scan MB/s over
marker-free MB/s, same unit) and `per_hit_us` (the time above it, per hit) say what hits cost.

A codec remembers the head matches it has decoded, so a marker seen again costs a dict lookup.
Every timed pass gets a new codec, as every evaluation of the leak oracle does: a pass finds
remembered only what it met earlier in itself. At 10 markers in flight the corpus holds 20
distinct whole markers, so nearly every hit is a repeat; at 1,000,000 nearly none is
(`distinct_hits`).

Own skipped (per response only): the scan as the leak oracle calls it, with each response's own
two markers passed (`MarkerCodec.scan(text, own)`), so a reply that echoes its prompt's markers
costs one lookup per echo, however many markers are in flight. Timed in the same repetitions,
and checked to find the same hits as the plain scan less those markers.

    .venv/bin/python benchmarks/marker_scan.py                  # about 13 s on 2 cores
    .venv/bin/python benchmarks/marker_scan.py --mb 4 --reps 5 --counts 10,10000,1000000 --json out.json
    .venv/bin/python benchmarks/marker_scan.py --short --json out.json   # a second or two: the tests' run
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

try:
    import chaos  # noqa: F401  (installed, or run from the repository root)
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from chaos.markers import ALPHABET, HitKind, MarkerCodec

RUN_PREFIX = "K7QX"
FOREIGN_PREFIX = "9ZM3"
SLOTS = 2  # every prompt carries its request's slot 0 and slot 1 markers

_WORDS = (
    "the of and to in is that for it as with was on be by this are from at or an have not but "
    "which one all were when there can more if no out so what up about into than them only time "
    "model request server cache page token prefill decode transfer latency batch queue worker "
    "memory router stream response prompt output input kernel tensor layer attention value key "
    "result error retry timeout node cluster pool thread process buffer offset index length "
    "first second third last next before after because however therefore also each every other"
).split()
_PROPER = [
    "GPU",
    "KV",
    "HTTP",
    "API",
    "JSON",
    "SGLang",
    "NVIDIA",
    "CUDA",
    "UTC",
    "TCP",
    "RDMA",
    "LLM",
    "Linux",
    "Python",
    "Monday",
    "London",
    "OK",
    "ID",
    "US",
    "EU",
    "FAQ",
    "TTFT",
    "P99",
]
_CODE = [
    (
        "```python\ndef handle(request):\n    if request.rid in self.pending:\n        return self.pending[request.rid]\n"
        "    return None\n```\n"
    ),
    '```bash\ncurl -s http://127.0.0.1:30000/generate -d \'{"text": "hello", "sampling_params": {}}\'\n```\n',
    '```json\n{"status": "ok", "pages": [12, 13, 14], "latency_ms": 41.7}\n```\n',
    "| field | value |\n|---|---|\n| page_size | 16 |\n| max_total_tokens | 4096 |\n",
]


# ------------------------------------------------------------------------------- corpus ----


def in_flight_marker(codec: MarkerCodec, k: int) -> str:
    """The k-th marker in flight: request k // 2, slot k % 2."""
    return codec.marker(k // SLOTS, k % SLOTS)


def _sentence(rng: random.Random) -> str:
    words = []
    for _ in range(rng.randint(6, 22)):
        roll = rng.random()
        if roll < 0.06:
            words.append(rng.choice(_PROPER))
        elif roll < 0.09:
            words.append(str(rng.randint(0, 99999)))
        elif roll < 0.10:
            # an upper-case identifier or hex: the tail pattern's literal must skip past these
            words.append("".join(rng.choice(ALPHABET) for _ in range(rng.randint(6, 14))))
        else:
            words.append(rng.choice(_WORDS))
    text = " ".join(words)
    punct = rng.choice([".", ".", ".", "?", "!", ":"])
    return text[0].upper() + text[1:] + punct


def _prose(rng: random.Random, chars: int) -> str:
    parts: list[str] = []
    size = 0
    while size < chars:
        if rng.random() < 0.04:
            piece = "\n" + rng.choice(_CODE)
        elif rng.random() < 0.08:
            piece = "\n\n- " + _sentence(rng)
        else:
            piece = " " + _sentence(rng)
        parts.append(piece)
        size += len(piece)
    return "".join(parts)


@dataclass
class Corpus:
    responses: list[str]
    embedded_whole: int = 0  # whole markers of this run written into it
    fragments: int = 0
    foreign: int = 0
    embedded: set[str] = field(default_factory=set)  # the distinct whole markers of this run in it
    owners: list[tuple[str, str]] = field(default_factory=list)  # each response's own markers, as a record has them
    bytes: int = 0
    joined: str = ""


def build_corpus(
    codec: MarkerCodec, foreign: MarkerCodec, in_flight: int, target_bytes: int, seed: int, *, markers: bool = True
) -> Corpus:
    """Responses of model-like text; markers from the `in_flight` markers of this run.

    The same seed gives the same texts, lengths and marker positions for every `in_flight`:
    only the request numbers inside the markers differ. `markers=False`: prose from the same
    generator, no markers.
    """
    rng = random.Random(seed)  # texts, lengths, positions: the same for every count
    pick = random.Random(seed + 1)  # request numbers (rejection sampling draws a count-dependent amount)
    requests = max(1, in_flight // SLOTS)
    corpus = Corpus(responses=[])
    size = 0
    while size < target_bytes:
        length = int(min(6000, max(200, rng.lognormvariate(7.0, 0.7))))  # median ~1.1 KB
        body = _prose(rng, length)
        owner = pick.randrange(requests)
        corpus.owners.append((codec.marker(owner, 0), codec.marker(owner, 1)))
        if not markers:
            corpus.responses.append(body)
            size += len(body)
            continue
        if rng.random() < 0.5:  # the model repeats its prompt: both of its own markers come back
            cut = rng.randrange(len(body))
            head, tail = codec.marker(owner, 0), codec.marker(owner, 1)
            body = head + " " + body[:cut] + " " + tail + body[cut:]
            corpus.embedded_whole += 2
            corpus.embedded.update((head, tail))
        if rng.random() < 0.02:  # a KV page cut through another request's marker
            other = codec.marker(pick.randrange(requests), pick.randrange(SLOTS))
            piece = other[: rng.randint(7, 16)] if rng.random() < 0.5 else other[rng.randint(1, 3) :]
            cut = rng.randrange(len(body))
            body = body[:cut] + piece + body[cut:]
            corpus.fragments += 1
        if rng.random() < 0.005:  # a marker of another run (a shared cache across runs)
            cut = rng.randrange(len(body))
            body = body[:cut] + " " + foreign.marker(pick.randrange(requests), 0) + " " + body[cut:]
            corpus.foreign += 1
        corpus.responses.append(body)
        size += len(body)
    corpus.bytes = size  # ASCII: characters are bytes
    corpus.joined = "".join(corpus.responses)
    return corpus


# ------------------------------------------------------------------------------ methods ----


def scan_responses(codec: MarkerCodec, texts: Sequence[str]) -> int:
    hits = 0
    scan = codec.scan
    for text in texts:
        hits += len(scan(text))
    return hits


def scan_responses_own(codec: MarkerCodec, texts: Sequence[str], owners: Sequence[tuple[str, str]]) -> int:
    """As the leak oracle calls it: each response's own markers passed, and left out."""
    hits = 0
    scan = codec.scan
    for text, own in zip(texts, owners, strict=True):
        hits += len(scan(text, own))
    return hits


def naive_responses(markers: Sequence[str], texts: Sequence[str]) -> int:
    hits = 0
    for text in texts:
        find = text.find
        for marker in markers:
            if find(marker) >= 0:
                hits += 1
    return hits


def naive_joined(markers: Sequence[str], text: str) -> int:
    """Every occurrence: in one string, a hit must be placed in its response afterwards."""
    hits = 0
    find = text.find
    for marker in markers:
        at = find(marker)
        while at >= 0:
            hits += 1
            at = find(marker, at + 1)
    return hits


def timed(fn: Callable[[], int]) -> tuple[float, int]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def check_agreement(codec: MarkerCodec, corpus: Corpus, sample: Sequence[str]) -> tuple[bool, int]:
    """Both methods find the same whole markers of the sample in every response."""
    wanted = set(sample)
    agree, found = True, 0
    for text in corpus.responses:
        by_scan = {h.text for h in codec.scan(text) if h.kind is HitKind.WHOLE and h.verified and h.text in wanted}
        by_find = {m for m in sample if m in text}
        agree &= by_scan == by_find
        found += len(by_find)
    return agree, found


def own_agrees(codec: MarkerCodec, corpus: Corpus) -> bool:
    """The scan with a response's own markers passed finds the same hits, less those markers."""
    for text, own in zip(corpus.responses, corpus.owners, strict=True):
        every = codec.scan(text)
        if codec.scan(text, own) != [h for h in every if not (h.kind is HitKind.WHOLE and h.text in own)]:
            return False
    return True


@dataclass
class Row:
    unit: str
    in_flight: int
    sample: int
    scan_s: list[float] = field(default_factory=list)
    clean_s: list[float] = field(default_factory=list)  # the marker-free corpus, in the same repetitions
    own_s: list[float] = field(default_factory=list)  # the scan with each response's own markers passed
    clean_mb: float = 0.0
    naive_s: list[float] = field(default_factory=list)  # extrapolated to all markers in flight
    scan_hits: int = 0
    own_hits: int = 0
    distinct_hits: int = 0  # distinct hit texts: what a codec can remember within one pass
    agree: bool = True
    sample_found: int = 0

    def summary(self, mb: float) -> dict[str, Any]:
        scan, naive = statistics.median(self.scan_s), statistics.median(self.naive_s)
        clean_mb_s = self.clean_mb / statistics.median(self.clean_s)
        return {
            "unit": self.unit,
            "markers_in_flight": self.in_flight,
            "naive_markers_timed": self.sample,
            "extrapolated": self.sample < self.in_flight,
            "scan_s": scan,
            "naive_s": naive,
            "scan_mb_s": mb / scan,
            "naive_mb_s": mb / naive,
            "scan_over_naive": naive / scan,
            "clean_mb_s": clean_mb_s,
            "clean_mb_s_range": [self.clean_mb / max(self.clean_s), self.clean_mb / min(self.clean_s)],
            "scan_over_clean": mb / scan / clean_mb_s,
            "scan_own_mb_s": mb / statistics.median(self.own_s) if self.own_s else None,
            "scan_own_over_clean": mb / statistics.median(self.own_s) / clean_mb_s if self.own_s else None,
            "scan_own_over_naive": naive / statistics.median(self.own_s) if self.own_s else None,
            "scan_own_hits": self.own_hits if self.own_s else None,
            "per_hit_us": (scan - mb / clean_mb_s) / max(self.scan_hits, 1) * 1e6,
            "scan_mb_s_range": [mb / max(self.scan_s), mb / min(self.scan_s)],
            "naive_mb_s_range": [mb / max(self.naive_s), mb / min(self.naive_s)],
            "mb": mb,
            "scan_hits": self.scan_hits,
            "distinct_hits": self.distinct_hits,
            "methods_agree": self.agree,
            "sample_found": self.sample_found,
        }


def measure(
    codec: MarkerCodec,
    corpus: Corpus,
    clean: Corpus,
    in_flight: int,
    unit: str,
    reps: int,
    budget_s: float,
    rng: random.Random,
) -> Row:
    texts: list[str] = corpus.responses if unit == "response" else [corpus.joined]
    clean_texts: list[str] = clean.responses if unit == "response" else [clean.joined]

    def naive(markers: Sequence[str]) -> int:
        return naive_responses(markers, texts) if unit == "response" else naive_joined(markers, corpus.joined)

    # Calibrate the naive search on up to 20 markers, then size the sample to the budget.
    probe = [in_flight_marker(codec, k) for k in rng.sample(range(in_flight), min(20, in_flight))]
    per_marker = max(timed(lambda: naive(probe))[0] / len(probe), 1e-7)
    size = max(min(20, in_flight), min(in_flight, int(budget_s / per_marker)))
    picks = range(in_flight) if size == in_flight else rng.sample(range(in_flight), size)
    sample = [in_flight_marker(codec, k) for k in picks]
    row = Row(unit=unit, in_flight=in_flight, sample=len(sample), clean_mb=clean.bytes / 1e6)
    row.distinct_hits = len({hit.text for text in texts for hit in codec.scan(text)})
    if unit == "response":  # the timing sample plus markers known to be in the text, so hits are compared too
        known = sorted(corpus.embedded)[:50]
        row.agree, row.sample_found = check_agreement(codec, corpus, sorted(set(sample) | set(known)))
        row.agree &= own_agrees(codec, corpus)
    scale = in_flight / len(sample)
    methods = ("scan", "clean", "naive") + (("own",) if unit == "response" else ())
    for rep in range(reps):
        turn = rep % len(methods)
        for method in methods[turn:] + methods[:turn]:  # each goes first in turn
            fresh = MarkerCodec(codec.run_prefix)  # remembers nothing from earlier passes
            if method == "scan":
                seconds, row.scan_hits = timed(functools.partial(scan_responses, fresh, texts))
                row.scan_s.append(seconds)
            elif method == "own":
                seconds, row.own_hits = timed(functools.partial(scan_responses_own, fresh, texts, corpus.owners))
                row.own_s.append(seconds)
            elif method == "clean":
                row.clean_s.append(timed(functools.partial(scan_responses, fresh, clean_texts))[0])
            else:
                seconds, _ = timed(lambda: naive(sample))
                row.naive_s.append(seconds * scale)
    return row


# ------------------------------------------------------------------------------- output ----


def machine() -> dict[str, Any]:
    model = "unknown"
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_model": model,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "loadavg": list(os.getloadavg()),
    }


def fmt(value: float) -> str:
    if value >= 100:
        return f"{value:,.0f}"
    if value >= 1:
        return f"{value:.1f}"
    if value >= 0.01:
        return f"{value:.3f}"
    return f"{value:.2g}"


def markdown(report: dict[str, Any]) -> str:
    m, c = report["machine"], report["corpus"]
    lines = [
        f"- machine: {m['nproc']} usable CPUs, {m['cpu_model']}; Linux {m['kernel']}, Python {m['python']}",
        (
            f"- load average at start {' '.join(f'{x:.2f}' for x in m['loadavg'])}, "
            f"at end {' '.join(f'{x:.2f}' for x in report['loadavg_end'])}"
        ),
        (
            f"- corpus: {c['mb']:.2f} MB in {c['responses']:,} responses (median {c['median_chars']:,} chars); per count "
            f"{c['embedded_whole']:,} whole markers of this run, {c['fragments']} fragments, {c['foreign']} other-run markers"
        ),
        (
            f"- marker-free corpus: {report['clean_corpus']['mb']:.2f} MB in {report['clean_corpus']['responses']:,} "
            "responses of the same generator's prose, scanned like the others (what the scan costs with no hit to decode)"
        ),
        (
            f"- {report['reps']} repetitions, medians; in each, the scan, the marker-free pass and the naive search "
            "take turns going first; every scan pass gets a new codec (nothing remembered from earlier passes)"
        ),
        (
            "- methods agree: on the timed markers plus 50 markers known to be in the corpus, both find the same whole "
            "markers in every response; and the scan with each response's own markers passed finds the same hits less those"
        ),
        (
            "- own skipped: the scan as the leak oracle calls it, each response's own two markers passed "
            "(`MarkerCodec.scan(text, own)`), timed in the same repetitions"
        ),
        "",
        (
            "| markers in flight | unit | scan MB/s | marker-free MB/s | scan / marker-free speed | µs per hit | "
            "own skipped MB/s | own skipped / marker-free | "
            "naive MB/s | scan / naive speed | own skipped / naive | naive markers timed | scan hits (distinct) | methods agree |"
        ),
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in report["rows"]:
        timed_note = f"{r['naive_markers_timed']:,}" + (" (extrapolated)" if r["extrapolated"] else " (all)")
        agree = (
            ("yes" if r["methods_agree"] else "**NO**") + f" ({r['sample_found']:,} found)"
            if r["unit"] == "response"
            else "–"
        )
        own = f"{fmt(r['scan_own_mb_s'])} | {r['scan_own_over_clean']:.2f}×" if r.get("scan_own_mb_s") else "– | –"
        own_naive = f"{fmt(r['scan_own_over_naive'])}×" if r.get("scan_own_over_naive") else "–"
        lines.append(
            f"| {r['markers_in_flight']:,} | {r['unit']} | {fmt(r['scan_mb_s'])} | {fmt(r['clean_mb_s'])} | "
            f"{r['scan_over_clean']:.2f}× | "
            f"{r['per_hit_us']:.2f} | {own} | {fmt(r['naive_mb_s'])} | {fmt(r['scan_over_naive'])}× | {own_naive} | "
            f"{timed_note} | "
            f"{r['scan_hits']:,} ({r['distinct_hits']:,}) | {agree} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, default=6.0, help="corpus size in MB (default 6)")
    p.add_argument("--counts", default="10,10000,1000000", help="markers in flight, comma-separated")
    p.add_argument("--units", default="response,joined", help="response (one call per response), joined (one string)")
    p.add_argument("--reps", type=int, default=5, help="repetitions per cell; the table gives medians")
    p.add_argument(
        "--naive-budget",
        type=float,
        default=0.4,
        help="seconds one naive repetition may take; larger counts are sampled and extrapolated",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", default=None, help="also write the report here")
    p.add_argument("--short", action="store_true", help="the tests' run: 0.2 MB, one repetition, a 0.02 s naive budget")
    args = p.parse_args(argv)
    if args.short:
        args.mb, args.reps, args.naive_budget = 0.2, 1, 0.02
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    counts = [int(x) for x in args.counts.split(",")]
    units = [u.strip() for u in args.units.split(",")]
    if any(u not in ("response", "joined") for u in units):
        raise SystemExit("--units: response and/or joined")
    codec, foreign = MarkerCodec(RUN_PREFIX), MarkerCodec(FOREIGN_PREFIX)
    report: dict[str, Any] = {"machine": machine(), "reps": args.reps, "rows": []}
    rng = random.Random(args.seed)
    shape: dict[str, Any] = {}
    clean = build_corpus(codec, foreign, 1, int(args.mb * 1e6), args.seed, markers=False)
    report["clean_corpus"] = {"mb": clean.bytes / 1e6, "responses": len(clean.responses)}
    for count in counts:
        corpus = build_corpus(codec, foreign, count, int(args.mb * 1e6), args.seed)
        mb = corpus.bytes / 1e6
        lengths = sorted(len(t) for t in corpus.responses)
        shape = {
            "mb": mb,
            "responses": len(corpus.responses),
            "median_chars": lengths[len(lengths) // 2],
            "embedded_whole": corpus.embedded_whole,
            "fragments": corpus.fragments,
            "foreign": corpus.foreign,
        }
        for unit in units:
            row = measure(codec, corpus, clean, count, unit, args.reps, args.naive_budget, rng).summary(mb)
            report["rows"].append(row)
            print(
                f"[marker_scan] {count:>9,} in flight, {unit:8}: scan {fmt(row['scan_mb_s'])} MB/s "
                f"({row['scan_over_clean']:.2f}x marker-free), naive {fmt(row['naive_mb_s'])} MB/s "
                f"({row['naive_markers_timed']:,} timed)",
                file=sys.stderr,
                flush=True,
            )
    report["corpus"] = shape
    report["loadavg_end"] = list(os.getloadavg())
    print(markdown(report))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
    return 0 if all(r["methods_agree"] for r in report["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
