"""One over-length sizer: the load's user and the faults/canary plan their sizes with the same
`Threshold` type from loadprofiles/sizing.py, and the band's completion budget is one rule."""

from __future__ import annotations

from chaos.markers import MarkerCodec, new_run_prefix
from chaos.targets.discovery import TargetFacts
from loadprofiles.prompts import PromptFactory
from loadprofiles.sizing import (
    UNKNOWN_OVER_LENGTH,
    Threshold,
    plan_load_thresholds,
    plan_thresholds,
)

# (pool, context, max input): the incident's decode worker.
LIMITS = (39312, 8192, 8186)


def sizes(thresholds: list[Threshold]) -> list[tuple[str, int, int]]:
    return [(t.name, t.tokens, t.target) for t in thresholds]


def test_the_same_limits_give_each_use_its_sizes() -> None:
    # Faults and canary: just over each limit, merged and smallest first.
    assert sizes(plan_thresholds([LIMITS])) == [
        ("band", 8186, 8189),
        ("context", 8192, 8193),
        ("pool", 39312, 39313),
    ]
    # The load: at and a margin (max(16, limit // 50)) over each limit, then the band, in that order.
    assert sizes(plan_load_thresholds(LIMITS)) == [
        ("at_context_length", 8192, 8192),
        ("over_context_length", 8192, 8192 + 163),
        ("at_max_total_num_tokens", 39312, 39312),
        ("over_max_total_num_tokens", 39312, 39312 + 786),
        ("band_max_req_input_len", 8186, 8189),
    ]
    small = plan_load_thresholds((None, 512, None))
    assert sizes(small) == [("at_context_length", 512, 512), ("over_context_length", 512, 528)]


def test_the_load_user_plans_with_the_one_planner() -> None:
    facts = TargetFacts(context_length=8192, max_total_num_tokens=39312, max_req_input_len=8186)
    assert facts.as_tuple() == LIMITS
    factory = PromptFactory(MarkerCodec(new_run_prefix()), seed=1, facts=facts)
    thresholds = factory.thresholds()
    assert thresholds == plan_load_thresholds(LIMITS)
    assert all(type(t) is Threshold for t in thresholds)
    prompt = factory.over_length(0, thresholds[-1])
    assert prompt.threshold is thresholds[-1]


def test_the_band_is_the_same_threshold_for_both_uses() -> None:
    fault_band = next(t for t in plan_thresholds([LIMITS]) if t.upper is not None)
    load_band = next(t for t in plan_load_thresholds(LIMITS) if t.in_band)
    assert (fault_band.tokens, fault_band.target, fault_band.upper, fault_band.label) == (
        load_band.tokens,
        load_band.target,
        load_band.upper,
        load_band.label,
    )
    # One completion budget rule: room under the context, at least one token, at most eight.
    assert fault_band.max_new_tokens() == load_band.max_new_tokens() == 3
    facts = TargetFacts(context_length=8192, max_total_num_tokens=39312, max_req_input_len=8186)
    factory = PromptFactory(MarkerCodec(new_run_prefix()), seed=1, facts=facts)
    by_name = {t.name: factory.over_length(i, t) for i, t in enumerate(factory.thresholds())}
    assert by_name["band_max_req_input_len"].max_tokens == 3 and not by_name["band_max_req_input_len"].chat_ok
    # Outside the band the load sends the config's max_tokens, on any route.
    assert all(p.max_tokens is None and p.chat_ok for n, p in by_name.items() if n != "band_max_req_input_len")


def test_no_stated_limit() -> None:
    assert plan_thresholds([(None, None, None)]) == []
    assert sizes(plan_thresholds([(None, None, None)], manual=100)) == [("manual", 100, 101), ("manual", 100, 200)]
    (assumed,) = plan_load_thresholds((None, None, None))
    assert (assumed.name, assumed.tokens, assumed.target, assumed.known) == (
        "assumed_limit",
        UNKNOWN_OVER_LENGTH,
        UNKNOWN_OVER_LENGTH,
        False,
    )
    assert all(t.known for t in plan_load_thresholds(LIMITS) + plan_thresholds([LIMITS], manual=100))
