"""The saturation gate: a load generator behind its schedule measured itself, not the target."""

from __future__ import annotations

from chaos.loadstats import Distribution, generator_saturation


def _lags(on_time: int, late: int, late_s: float = 0.5) -> Distribution:
    return Distribution.of([0.002] * on_time + [late_s] * late)


def test_a_generator_on_schedule_is_not_saturated() -> None:
    assert generator_saturation([35.0, 40.0, 42.0], _lags(200, 0)) is None


def test_a_few_late_sends_among_hundreds_are_noise_not_saturation() -> None:
    """The vLLM tier on a busy 2-core machine: 5 of 181 sends late by 0.3-0.5 s."""
    assert generator_saturation([60.0], _lags(176, 5)) is None


def test_a_generator_late_on_one_send_in_ten_is_saturated_and_says_by_how_much() -> None:
    why = generator_saturation([60.0], _lags(170, 30, late_s=0.4))
    assert why is not None and "400 ms" in why and "p90" in why and "200 requests" in why


def test_a_generator_pinned_at_a_core_is_saturated() -> None:
    why = generator_saturation([95.0, 97.0, 99.0], _lags(200, 0))
    assert why is not None and "97 %" in why
