"""The vLLM CPU pair's read-after-free, shown as a cross-request content leak by the telltale model
(`chaos/targets/vllm/lease_leak.py`, docs/vllm-tier.md).

Request A's KV lease expires while decode is paused; prefill frees A's blocks and fills them with
other prompts; decode then pulls A's block ids anyway. Served by the telltale model, whose greedy
reply names the marker words in the KV it attends, A's reply (HTTP 200) names the words of the
requests that reused its blocks, words A's own prompt never held. The pair gets its own module: a
small pool (4 MiB) and the telltale model, unlike the campaigns' pair in tests/test_vllm_pair.py,
which runs first (file order): its campaign judges the load generator's headroom, and this module's
pair must be gone by then.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from chaos.targets.models.telltale import load_words
from chaos.targets.vllm.lease_leak import LeaseLeak, ensure_model, leak_spec, prompt, reproduce
from chaos.targets.vllm.stack import VllmStack
from tests.conftest import running

REPO = Path(__file__).resolve().parents[1]
VENV = REPO / ".venv-vllm"

pytestmark = pytest.mark.real_engine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not (VENV / "bin" / "python").exists():
        pytest.skip(f"{VENV} is missing: run `make vllm-env` (CI does)")
    model = tmp_path_factory.mktemp("telltale") / "model"
    ensure_model(model, VENV / "bin" / "python")
    return model


@pytest.fixture(scope="module")
def leak(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LeaseLeak]:
    with running(VllmStack(leak_spec(model_dir, str(VENV)), tmp_path_factory.mktemp("vllm-lease-leak"))) as stack:
        yield reproduce(stack, load_words(model_dir))


@pytest.mark.timeout(900)
def test_a_reply_after_lease_expiry_quotes_the_requests_that_reused_its_blocks(
    leak: LeaseLeak, model_dir: Path
) -> None:
    assert leak.expiry_logged  # prefill freed A's blocks, as designed
    assert leak.status == 200, leak.reply
    assert leak.leaked, f"A's reply {leak.reply!r} names no other request: the freed blocks were not reused"
    words = load_words(model_dir)
    own_prompt = set(prompt(leak.own, 240).split())
    for word in leak.leaked:  # a word A's prompt never held: it came from another request's KV
        assert f"#{word}" not in own_prompt and word != leak.own
    # each B answered with its own word: the model names what it attends, on this very pair
    assert all(leak.other_replies[name].split() == [word] for word, name in leak.others.items()), leak.other_replies
    assert set(leak.named) <= set(words)


def test_the_reproduction_is_runnable_as_a_module() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "chaos.targets.vllm.lease_leak", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        check=False,
    )
    assert result.returncode == 0 and "--model" in result.stdout
