"""The reference probes: what they hold, and the order they are replayed in under load."""

from __future__ import annotations

from chaos.oracles.canary import MarkerCodec
from chaos.probes import ADAPTER_PREFIX, build_probes, replay_order


def test_adapter_probes_share_an_opening_and_are_replayed_back_to_back() -> None:
    probes = build_probes(MarkerCodec("K7QX"), 9, 2048, 16)
    adapters = [p for p in probes if p.lora_path]
    assert [p.index for p in adapters] == [2, 5, 8]
    assert {p.lora_path for p in adapters} == {"adapter-a", "adapter-b"}
    assert all(p.prompt.startswith(ADAPTER_PREFIX) for p in adapters)
    assert not any(p.prompt.startswith(ADAPTER_PREFIX) for p in probes if not p.lora_path)

    order = replay_order(probes)
    assert sorted(p.index for p in order) == list(range(9))  # every probe, once
    assert [p.index for p in order] == [0, 1, 2, 5, 8, 3, 4, 6, 7]
    # each adapter probe directly follows one under the other adapter (after the first)
    lora = [p.lora_path for p in order if p.lora_path]
    assert all(a != b for a, b in zip(lora, lora[1:]))


def test_without_adapter_probes_the_order_is_unchanged() -> None:
    probes = build_probes(MarkerCodec("K7QX"), 2, 2048, 16)
    assert not any(p.lora_path for p in probes)
    assert replay_order(probes) == probes
