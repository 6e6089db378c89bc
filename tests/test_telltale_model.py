"""The telltale tiny Llama (chaos/targets/models/telltale.py): its greedy reply names the marker
words in the KV it attends, so a leaked page names its owner.

The model tests need torch, transformers and tokenizers. They run in this interpreter when it has
them; otherwise the whole proof runs once in the vLLM venv (`make vllm-env` makes it; CI does), as
`telltale.py --prove`; otherwise they skip, saying so. The word-list tests need none of them.

Script mode, with any python that has torch, transformers and tokenizers (builds into MODEL_DIR
when it holds no model yet, then prints the figures as JSON; PAIRS defaults to 50):
    python chaos/targets/models/telltale.py --prove MODEL_DIR [PAIRS]
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MODULE = REPO / "chaos" / "targets" / "models" / "telltale.py"
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"


def _load_telltale():
    """By path, so that script mode works from any venv without pdchaos installed."""
    spec = importlib.util.spec_from_file_location("telltale_under_test", MODULE)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


telltale = _load_telltale()
HAVE_TORCH = all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers", "tokenizers"))
NO_TORCH = "torch, transformers and tokenizers are not importable in this interpreter"


# ---------------------------------------------------------------- no torch needed


def test_stopwords_cover_the_suites_prompt_texts() -> None:
    """Every word the suite's prompts are made of is a stop word, so none is (or splits into) a
    marker word: ordinary prompt text never counts as a marker nor suppresses one."""
    from chaos import probes, tenant_probe
    from loadprofiles import prompts

    texts = [
        *prompts._WORDS,
        *prompts.REPEAT_INSTRUCTIONS,
        *prompts.OTHER_INSTRUCTIONS,
        prompts.SYSTEM_INTRO,
        probes.FILLER,
        probes.ADAPTER_PREFIX,
        *probes.ADAPTERS,
        tenant_probe.VICTIM_QUESTION,
        tenant_probe.ATTACKER_QUESTION,
        "Confidential note:",
        *tenant_probe._WORDS,
    ]
    words = {w for text in texts for w in re.findall(r"[A-Za-z]+", text)}
    assert words - telltale.STOPWORDS == set()
    assert set(telltale.FILLER) <= telltale.STOPWORDS


def test_word_for_wraps_and_read_reply_keeps_order() -> None:
    words = ["alpha", "beta", "gamma"]
    assert [telltale.word_for(i, words) for i in range(5)] == ["alpha", "beta", "gamma", "alpha", "beta"]
    assert telltale.read_reply(" gamma alpha</s>", words) == ["gamma"]  # "alpha</s>" is no word
    assert telltale.read_reply(" gamma alpha", words) == ["gamma", "alpha"]
    assert telltale.read_reply(" UULK7QX00002B19F3 beta delta", words) == ["beta"]


@pytest.mark.parametrize("page", [3, 16, 64])
def test_telltale_text_puts_the_word_in_every_page(page: int) -> None:
    """Counting tokens as a BPE does: a filler word is one token, " #w" two ("#" and "w")."""
    filler = [random.Random(page).choice(telltale.FILLER) for _ in range(300)]
    text = telltale.telltale_text("socket", filler, page=page)
    tokens: list[str] = []
    for piece in text.split(" ")[1:]:
        tokens += ["#", "socket"] if piece == "#socket" else [piece]
    assert len([t for t in tokens if t != "#" and t != "socket"]) == 300
    assert all("socket" in tokens[i : i + page] for i in range(len(tokens) - page + 1))


# ---------------------------------------------------------------- the model, in this interpreter


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not HAVE_TORCH:
        pytest.skip(NO_TORCH + " (test_proof_in_the_vllm_venv runs these checks there)")
    out = tmp_path_factory.mktemp("telltale")
    telltale.build(out)
    return out


@pytest.fixture(scope="module")
def tt(built: Path):
    return telltale.Telltale(built)


def test_rebuild_is_byte_identical(built: Path, tmp_path: Path) -> None:
    telltale.build(tmp_path)
    names = sorted(p.name for p in built.iterdir())
    assert names == sorted(p.name for p in tmp_path.iterdir())
    assert all((built / n).read_bytes() == (tmp_path / n).read_bytes() for n in names)
    assert sum((built / n).stat().st_size for n in names) < 50 << 20


def test_words_are_single_tokens_in_both_forms(tt) -> None:
    assert len(tt.words) >= 100
    for word in tt.words:
        assert tt.prompt_id[word] in tt.encode(f"the #{word} and")
        assert tt.encode(f" {word}") == [tt.by_reply_id_rev[word]]


def test_a_text_prompt_names_its_word_and_stops(tt) -> None:
    rng = random.Random(1)
    for word in rng.sample(tt.words, 8):
        text = telltale.telltale_text(word, [rng.choice(telltale.FILLER) for _ in range(rng.randrange(5, 300))])
        emitted = tt.generate(tt.encode(text))
        assert emitted[-1] == telltale.EOS_ID
        assert tt.tokenizer.decode(emitted, skip_special_tokens=True) == " " + word
        assert telltale.read_reply(tt.tokenizer.decode(emitted, skip_special_tokens=True), tt.words) == [word]


def test_a_prompt_without_a_marker_word_gets_an_empty_reply(tt) -> None:
    assert tt.generate(tt.encode("Please repeat this note exactly. the and for")) == [telltale.EOS_ID]


def test_under_the_chat_template_the_word_is_still_named(tt) -> None:
    word = tt.words[7]
    body = telltale.telltale_text(word, list(telltale.FILLER) * 4)
    chat = tt.tokenizer.apply_chat_template(
        [
            {"role": "system", "content": "You are the support assistant of the infrastructure team."},
            {"role": "user", "content": "Please repeat this note exactly." + body},
        ],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert tt.reply_words(tt.generate(tt.encode(chat))) == [word]


def test_reply_lists_every_marker_word_most_frequent_first(tt) -> None:
    a, b, c = tt.words[3], tt.words[40], tt.words[90]
    text = f"the #{b} and #{a} for #{a} are #{c} but #{a} not #{b}"
    assert tt.reply_words(tt.generate(tt.encode(text))) == [a, b, c]


def test_one_occurrence_in_a_full_context_is_named(tt) -> None:
    rng = random.Random(2)
    word = tt.words[-1]
    ids = [rng.choice(tt.plain_ids) for _ in range(telltale.MAX_POSITIONS)]
    ids[5] = tt.prompt_id[word]
    assert tt.reply_words(tt.generate(ids)) == [word]


def test_a_leaked_page_names_the_victim(tt) -> None:
    """Decode attends one page of another request in place of one of its own."""
    rng = random.Random(3)
    for _ in range(6):
        own, victim = rng.sample(tt.words, 2)
        a, b = tt.marked_ids(own, 16 * rng.randrange(4, 20), rng), tt.marked_ids(victim, 16 * rng.randrange(4, 20), rng)
        first, kv_a = tt.prefill(a)
        _, kv_b = tt.prefill(b)
        assert tt.reply_words(tt.decode(kv_a, first)) == [own]
        tampered = telltale._splice(kv_a, 16 * rng.randrange(len(a) // 16), kv_b, 16 * rng.randrange(len(b) // 16), 16)
        assert tt.reply_words(tt.decode(tampered, first)) == [own, victim]


def test_foreign_kv_switches_the_first_token_once_it_outnumbers_the_own_word(tt) -> None:
    """Prefill of the last prompt token attends positions taken from another request."""
    rng = random.Random(4)
    own, victim = tt.words[10], tt.words[20]
    a, b = tt.marked_ids(own, 256, rng), tt.marked_ids(victim, 256, rng)
    _, kv_head = tt.prefill(a[:-1])
    _, kv_b = tt.prefill(b)
    for n in (1, 64, 128, 160, 200, 255):
        words = tt.reply_words(tt.decode(telltale._splice(kv_head, 0, kv_b, 0, n), a[-1], max_new=6)[1:])
        n_victim, n_own = b[:n].count(tt.prompt_id[victim]), a[n:].count(tt.prompt_id[own])
        ranked = sorted([(-n_victim, tt.by_reply_id_rev[victim], victim), (-n_own, tt.by_reply_id_rev[own], own)])
        assert words == [word for count, _, word in ranked if count], (n, n_victim, n_own)


# ---------------------------------------------------------------- the model, in the vLLM venv


@pytest.mark.timeout(900)
def test_proof_in_the_vllm_venv(tmp_path: Path) -> None:
    if HAVE_TORCH:
        pytest.skip("this interpreter has torch: the tests above ran the proof here")
    if not VLLM_PYTHON.exists():
        pytest.skip(NO_TORCH + f" and {VLLM_PYTHON} is missing (`make vllm-env` makes it)")
    done = subprocess.run(
        [str(VLLM_PYTHON), str(MODULE), "--prove", str(tmp_path / "telltale"), "8"],
        capture_output=True,
        text=True,
        timeout=850,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout)
    _assert_perfect(figures, 8)


def _assert_perfect(figures: dict, pairs: int) -> None:
    for key in (
        "text_prompt_names_own_word_only",
        "chat_prompt_names_own_word_only",
        "clean_reply_is_own_word_only",
        "one_leaked_page_names_victim",
        "one_leaked_page_reply_is_exactly_own_and_victim",
        "victim_kv_appended_names_victim",
        "one_foreign_marker_position_names_victim",
    ):
        assert figures[key] == pairs, (key, figures)
    assert figures["words_named_that_are_neither_own_nor_victim"] == 0
    assert figures["one_occurrence_in_full_context_named"] is True
    flips = figures["first_token_becomes_victim"]
    assert flips["found"] == flips["matches_count_rule"] == pairs, figures


def test_expected_reply_is_what_the_model_says(tt, built: Path) -> None:
    """The count rule, computed without the model, on prompts of several marker words and counts."""
    table = json.loads((built / "telltale.json").read_text())
    rng = random.Random(5)
    for _ in range(20):
        ids = [rng.choice(tt.plain_ids) for _ in range(rng.randrange(20, 600))]
        for word in rng.sample(tt.words, rng.randrange(0, 5)):
            for _ in range(rng.randrange(1, 6)):
                ids[rng.randrange(len(ids))] = tt.prompt_id[word]
        assert tt.reply_words(tt.generate(ids, max_new=8)) == telltale.expected_reply(ids, table)[:7]
