"""The incident on real SGLang 0.5.19 (before the admission fixes #36988 / #38935), on CPUs.

Prefill's pool is 1,024 tokens (max input 1,018), decode's 8,192, the context 2,048. A prompt
between the two limits is rejected by prefill's scheduler, yet 0.5.19 still hands it off as a
1-token stub and decode, which admitted the whole prompt, answers it: HTTP 200, `finish_reason:
length`, and an answer that does not depend on the prompt (every such prompt gets the same
tokens, whose first is the model's answer to the stub token alone). Issue #30233. The telltale
model shows whose KV that answer came from (the stub's, no victim's), and the incident campaign
FAILs here through the status oracle, which PASSes on 0.5.23. Needs `make sglang-env SGLANG_VERSION=0.5.19`
(skipped without it); each test starts its own pair (about 2-4 min on two cores).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from chaos.targets.sglang.spec import SGLangSpec
from chaos.targets.sglang.stack import SGLangStack
from chaos.verdict import Verdict
from tests.conftest import running
from tests.sglang_race import deaths_in_run

REPO = Path(__file__).resolve().parents[1]
VENV = REPO / ".venv-sglang-0.5.19"

pytestmark = pytest.mark.real_engine


@pytest.fixture()  # one pair at a time: each test starts its own and stops it (8 GB each)
def incident_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SGLangStack]:
    if not (VENV / ".installed").exists() or not (VENV / "models" / "tiny-llama" / ".built").exists():
        pytest.skip(f"{VENV} is missing: `make sglang-env SGLANG_VERSION=0.5.19` installs it")
    spec = SGLangSpec(
        device="cpu",
        venv=str(VENV),
        waiting_timeout_s=20,
        bootstrap_timeout_s=20,
        prefill={"max_total_tokens": 1024},
        decode={"max_total_tokens": 8192},
        router={"health_check_timeout_s": 25},
    )
    with running(SGLangStack(spec, tmp_path_factory.mktemp("sglang-0519"))) as stack:
        yield stack


def _generate(stack: SGLangStack, input_ids: list[int], max_new_tokens: int = 8, **sampling: object) -> httpx.Response:
    body = {"input_ids": input_ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, **sampling}}
    return httpx.post(f"{stack.router_url}/generate", json=body, timeout=120, trust_env=False)


@pytest.mark.timeout(900)
def test_rejected_prompts_are_handed_off_as_a_stub_and_answered_200(incident_pair: SGLangStack) -> None:
    info = httpx.get(f"{incident_pair.worker_url('prefill')}/server_info", timeout=10, trust_env=False).json()
    assert (info["version"], info["max_total_num_tokens"], info["max_req_input_len"]) == ("0.5.19", 1024, 1018)
    band = {
        n: _generate(incident_pair, [base + i % 1500 for i in range(n)])
        for n, base in ((1500, 100), (1300, 300), (1018, 700))
    }
    for n, response in band.items():  # rejected by prefill's scheduler, yet 200 "length"
        assert response.status_code == 200, (n, response.text[:300])
        assert response.json()["meta_info"]["finish_reason"]["type"] == "length"
    outputs = {n: tuple(r.json()["output_ids"]) for n, r in band.items()}
    assert len(set(outputs.values())) == 1, outputs  # the answer does not depend on the prompt
    stub = _generate(incident_pair, [0]).json()["output_ids"]
    assert next(iter(outputs.values()))[0] == stub[0]  # its first token is the stub's
    under = _generate(incident_pair, [100 + i for i in range(1017)])  # under both limits: a real answer
    assert under.status_code == 200 and tuple(under.json()["output_ids"]) not in outputs.values()
    assert "Input length (1500 tokens) exceeds the maximum allowed length (1018 tokens)" in incident_pair.logs(
        "prefill"
    )


# ------------------------------------------------------------------ the telltale model on 0.5.19 ----


@pytest.fixture()
def telltale_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SGLangStack, dict]]:
    """The incident's pools, serving the telltale model (docs/telltale-model.md). Decode's pool is
    2,048 tokens without a radix cache, so a finished request's pages go straight back to the free
    list and five 1,000-token requests write every one of them."""
    if not (VENV / ".installed").exists():
        pytest.skip(f"{VENV} is missing: `make sglang-env SGLANG_VERSION=0.5.19` installs it")
    model = tmp_path_factory.mktemp("telltale-model")
    subprocess.run(
        [str(VENV / "bin" / "python"), str(REPO / "chaos" / "targets" / "models" / "telltale.py"), str(model)],
        check=True,
        capture_output=True,
        timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    table = json.loads((model / "telltale.json").read_text())
    spec = SGLangSpec(
        device="cpu",
        venv=str(VENV),
        model_path=str(model),
        waiting_timeout_s=20,
        bootstrap_timeout_s=20,
        prefill={"max_total_tokens": 1024},
        decode={"max_total_tokens": 2048, "extra_args": ["--disable-radix-cache"]},
        router={"health_check_timeout_s": 25},
    )
    with running(SGLangStack(spec, tmp_path_factory.mktemp("sglang-0519-telltale"))) as stack:
        yield stack, table


def _marked(table: dict, word: int, tokens: int, every: int = 16) -> list[int]:
    """`tokens` ids: a filler token, with marker word `word`'s prompt form every `every` positions."""
    special = set(table["prompt_token_ids"]) | set(table["reply_token_ids"]) | {table["eos_token_id"]}
    filler = next(i for i in range(100, 2048) if i not in special)
    return [table["prompt_token_ids"][word] if i % every == every // 2 else filler for i in range(tokens)]


def _reply_words(stack: SGLangStack, table: dict, input_ids: list[int]) -> tuple[int, list[str]]:
    # ignore_eos: the stub's first token (prefill's, from one token of KV) is EOS, and decode, whose
    # attention is the point, would never run.
    response = _generate(stack, input_ids, max_new_tokens=4, ignore_eos=True)
    if response.status_code != 200:
        return response.status_code, []
    words = {rid: w for rid, w in zip(table["reply_token_ids"], table["words"], strict=False)}
    return 200, [words.get(t, f"<{t}>") for t in response.json()["output_ids"] if t != table["eos_token_id"]]


@pytest.mark.timeout(900)
def test_the_telltale_model_shows_the_rejected_prompt_answered_from_the_stub_not_from_a_victim(
    telltale_pair: tuple[SGLangStack, dict],
) -> None:
    """Five victims carrying marker word V fill decode's 2,048-token pool (no radix cache: their
    pages go back to the free list unzeroed). Then prompts between prefill's limit (1,018) and
    decode's, carrying V or W, are rejected by prefill's scheduler and handed off anyway as a
    one-token stub (issue #30233): 200 `length`. The telltale model names every marker word among
    the positions decode attends. Measured: the victims' replies name V (the model works on this
    engine), and the band replies name nothing, identically for V and W: decode answered from
    the stub alone, not from the prompt and not from the victims' stale pages. A reply naming V
    here would be a cross-request leak."""
    stack, table = telltale_pair
    victim_word, own_word = 0, 1
    for _ in range(5):
        assert _reply_words(stack, table, _marked(table, victim_word, 1000)) == (200, [table["words"][victim_word]])
    band = {word: _reply_words(stack, table, _marked(table, word, 1500)) for word in (own_word, victim_word)}
    assert all(status == 200 for status, _ in band.values()), band  # 0.5.19: the rejected request is answered
    assert band[own_word] == band[victim_word] == (200, []), f"a band reply names a marker word: {band}"
    assert "Input length (1500 tokens) exceeds the maximum allowed length (1018 tokens)" in stack.logs("prefill")


# --------------------------------------------------------------- the incident campaign, old vs new ----


@pytest.mark.timeout(1800)
def test_the_incident_campaign_fails_on_0519_and_passes_on_0523(tmp_path: Path) -> None:
    """`campaigns/sglang-cpu-incident.yaml` (behind smg) on the release before the admission fixes
    and on the current one, and `pdchaos compare` between them: the incident's silent 200 is gone,
    and 0.5.23 PASSes (the campaign turns off the pool preflight, which would FAIL the
    configuration itself on both releases). The only regression allowed is a new error class, seen
    in some runs and not others: a *streamed* prompt over prefill's limit answered 200 and aborted
    when decode's KV wait runs out, since smg forwards decode's stream before prefill's 400 arrives
    (docs/sglang-cpu-tier.md). When such aborts are there, each must be exactly that."""
    current = REPO / ".venv-sglang"
    if not (VENV / ".installed").exists() or not (current / ".installed").exists():
        pytest.skip("needs both `make sglang-env` and `make sglang-env SGLANG_VERSION=0.5.19`")
    from chaos.campaign_validation import load_campaign
    from chaos.runner import Runner
    from reports.compare import compare_runs
    from reports.model import load_run

    new = load_campaign(REPO / "campaigns" / "sglang-cpu-incident.yaml")
    assert new.target.sglang is not None
    old = new.model_copy(
        update={
            "target": new.target.model_copy(update={"sglang": new.target.sglang.model_copy(update={"venv": str(VENV)})})
        }
    )
    runs = {}
    for name, campaign in (("0.5.19", old), ("0.5.23", new)):  # one pair at a time
        runs[name] = Runner(campaign, tmp_path / name, progress=False).run()
        if deaths_in_run(runs[name].run_dir):  # SGLang's own race (tests/sglang_race.py): a dead engine was judged
            assert runs[name].verdict is not Verdict.PASS, f"{name}: the transfer thread died, yet the run PASSed"
            runs[name] = Runner(campaign, tmp_path / f"{name}-again", progress=False).run()

    def rules(run) -> set[str]:  # type: ignore[no-untyped-def]
        status = next(r for r in run.oracles if r.name == "status")
        return {f.evidence.get("rule") for f in status.findings if f.verdict is Verdict.FAIL}

    def failing(run) -> set[str]:  # type: ignore[no-untyped-def]
        return {r.name for r in run.oracles if r.verdict is Verdict.FAIL}

    assert runs["0.5.19"].verdict is Verdict.FAIL and "over_length_accepted" in rules(runs["0.5.19"])
    assert "pool_preflight" not in {r.name for r in runs["0.5.23"].oracles}
    assert runs["0.5.23"].verdict is Verdict.PASS and not failing(runs["0.5.23"]), runs["0.5.23"].reasons
    # Latency ratios off: two runs on two busy CPU cores say nothing about either release's speed.
    comparison = compare_runs(load_run(runs["0.5.19"].run_dir), load_run(runs["0.5.23"].run_dir), max_latency_ratio=0)
    assert any(i.startswith("failure gone: status over_length_accepted") for i in comparison.improvements), (
        comparison.improvements
    )
    # No regression, or only the abort class below (it depends on when prefill's 400 beats decode's stream).
    assert all(r.startswith("new error class abort:") for r in comparison.regressions), comparison.regressions
    from chaos.journal import Journal

    with Journal.open(runs["0.5.23"].run_dir, readonly=True) as journal:
        aborted = [r for r in journal.iter_requests() if r.error_class == "abort" and r.phase == "load"]
    waiting = new.target.sglang.waiting_timeout_s or 300
    for r in aborted:  # streamed, over prefill's 1,018 tokens, answered 200 and ended when decode's wait ran out
        assert r.stream and r.status == 200 and (r.prompt_tokens or 0) > 1018, r
        assert r.t_end is not None and r.t_send is not None and r.t_end - r.t_send >= waiting - 2, r
