"""Defect switches: each turns off one safeguard of the embedded engine, after a real bug.

All are off by default. Each reproduces the *mechanism* of a publicly reported bug
(bug classes K1–K9, docs/architecture.md), so a qualification run against an engine with the switch
on must FAIL, and the same run against the clean engine must PASS: that is how the suite proves
its oracles work. `pdchaos sim defects` lists them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Defect:
    name: str
    bug_class: str  # K1..K9, see docs/architecture.md
    summary: str
    mechanism: str
    references: str
    trigger: str  # what the campaign must do to hit it
    campaign: str  # the campaign in campaigns/defects/ that catches it
    caught_by: tuple[str, ...]  # oracles of which at least one must FAIL


DEFECTS: dict[str, Defect] = {
    d.name: d
    for d in (
        Defect(
            "rejected_prefill_handoff",
            "K3/K7",
            "a prompt prefill rejects as too long still enters the handoff as a one-token stub",
            "prefill's scheduler check (max_req_input_len) only marks the request to finish; the stub "
            "[0] is bootstrapped, one token of KV is sent and prefill reports success; decode, whose "
            "limits admit the prompt, preallocated all of it, accepts the one-token handoff and decodes "
            "over pages it never received",
            "SGLang #30233 (the incident), #35421, #38935",
            "asymmetric pools (memory_fraction on prefill) and prompts between the two limits",
            "incident",
            ("canary", "reference", "status", "timing"),
        ),
        Defect(
            "free_before_transfer_done",
            "K1",
            "decode frees a request's pages on abort or timeout while prefill may still write into them",
            "no deferred release: pages go straight back to the LIFO free list; the stalled sender's "
            "late write lands on whichever request got them next",
            "SGLang #35049 (also #35360, #41023, #38961)",
            "transfer stalls past the waiting timeout, client aborts during the transfer",
            "aborts",
            ("canary", "reference"),
        ),
        Defect(
            "commit_before_kv_lands",
            "K2",
            "the transfer-done signal is sent before the KV chunks, and decode starts on it",
            "the completion notice is not fenced behind the data: decode commits and decodes while the "
            "prompt's pages still hold their previous owner's KV",
            "SGLang PR #22811, #36738; vLLM #31210 (read before ready)",
            "any PD traffic; slow transfers widen the gap",
            "handoff",
            ("reference", "canary"),
        ),
        Defect(
            "partial_transfer_reported_complete",
            "K3",
            "the transfer connector drops the last KV chunk but reports the full length",
            "success for a subset: decode's coverage check trusts the reported count, so the tail pages keep stale KV",
            "vLLM #30358, NIXL HMA (vLLM #52234); SGLang #36371",
            "prompts longer than one transfer chunk",
            "handoff",
            ("reference",),
        ),
        Defect(
            "metadata_slot_collision",
            "K4",
            "decode matches transfer completions to requests by a small slot index, not by room",
            "the metadata buffer index collides under concurrency and no room check runs: a request "
            "commits with another request's first token and before its own KV has landed",
            "SGLang #22716 (also #17259, PR #17430)",
            "concurrent PD traffic",
            "handoff",
            ("reference", "canary", "usage"),
        ),
        Defect(
            "prefix_cache_keeps_evicted_pages",
            "K5",
            "evicting a prefix-cache page frees it but leaves its key in the index",
            "a later prefix hit maps to a page that was reallocated to another request: the prefix KV "
            "read is someone else's",
            "SGLang PR #31486, #35270 (radix tree references pages it no longer owns)",
            "shared prefixes plus eviction churn (small pool, long prompts)",
            "cache",
            ("canary", "reference"),
        ),
        Defect(
            "cache_key_ignores_adapter",
            "K6",
            "the prefix-cache key omits the LoRA adapter, an input that changes the KV",
            "a request under adapter B reuses pages computed under adapter A",
            "vLLM #3264, CVE-2025-46722 (cache key omits a non-token input)",
            "the same prompt under different adapters",
            "cache",
            ("reference",),
        ),
        Defect(
            "abort_reported_as_length",
            "K7",
            "a request aborted during the handoff is answered 200 with finish_reason length",
            "the success path overwrites the pending abort",
            "SGLang #33507/#33508 (also PR #8936)",
            "client aborts (by rid) during the transfer",
            "aborts",
            ("status",),
        ),
        Defect(
            "pages_leak_on_abort",
            "K8",
            "decode never reclaims the pages of requests aborted or timed out during the handoff",
            "reclaim waits for a signal that never comes: the pool shrinks with every abort until new "
            "requests wait forever",
            "SGLang PR #31800, #36988; vLLM PR #32255, #46283",
            "aborts or transfer timeouts",
            "aborts",
            ("liveness",),
        ),
        Defect(
            "prefix_cache_shared_across_tenants",
            "K9",
            "the prefix cache ignores the per-tenant cache salt",
            "one tenant's prompt makes another tenant's identical prefix hit the cache: time to first "
            "token (and cached_tokens) reveal what others asked",
            "vLLM CVE-2025-46570, SGLang #1504 (prefix-cache timing side channels)",
            "tenants probing each other's prefixes",
            "cache",
            ("tenant_isolation",),
        ),
    )
}


@dataclass(frozen=True)
class DefectSet:
    names: frozenset[str] = frozenset()

    @classmethod
    def of(cls, names: tuple[str, ...] | list[str]) -> DefectSet:
        unknown = sorted(set(names) - set(DEFECTS))
        if unknown:
            raise ValueError(f"unknown defect(s) {', '.join(unknown)}; known: {', '.join(DEFECTS)}")
        return cls(frozenset(names))

    def __contains__(self, name: str) -> bool:
        assert name in DEFECTS, f"no defect named {name}"
        return name in self.names
