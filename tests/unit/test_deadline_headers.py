"""A request's deadline from the headers unmodified clients send: which header counts for which
call, the margin kept back, and what a malformed value gets."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from starlette.datastructures import Headers

from modelforge.failures import FailureClass, ModelForgeError
from modelforge.gateway._deadlines import apply_deadline, header_deadline


def _deadline(headers: dict[str, str], streamed: bool = False) -> float | None:
    applied = header_deadline(Headers(headers), streamed=streamed)
    return None if applied is None else applied.deadline_s


def test_the_explicit_header_wins_and_counts_for_streams_too() -> None:
    both = {"x-request-timeout": "20", "x-stainless-read-timeout": "600"}
    assert _deadline(both) == 19.0
    assert _deadline(both, streamed=True) == 19.0
    # A short wait keeps back a fifth of it: the refusal must reach the client in time.
    assert _deadline({"x-request-timeout": "2"}) == 1.6


def test_the_sdks_read_timeouts_count_only_for_answers_sent_whole() -> None:
    openai_default = {"x-stainless-read-timeout": "600"}
    assert _deadline(openai_default) == 599.0
    assert _deadline(openai_default, streamed=True) is None
    anthropic = {"x-stainless-timeout": "60", "x-stainless-read-timeout": "600"}
    assert _deadline(anthropic) == 59.0
    assert _deadline({}) is None


@pytest.mark.parametrize("value", ["soon", "0", "-5", "nan", "inf", "604801", ""])
def test_a_malformed_explicit_timeout_is_refused_and_a_malformed_sdk_one_left_aside(value: str) -> None:
    with pytest.raises(ModelForgeError) as refused:
        header_deadline(Headers({"x-request-timeout": value}), streamed=False)
    assert refused.value.failure == FailureClass.REQUEST_INVALID and "X-Request-Timeout" in refused.value.message
    assert _deadline({"x-stainless-read-timeout": value}) is None


def test_the_bodys_deadline_wins_and_the_note_says_where_it_came_from() -> None:
    state = SimpleNamespace()
    options: dict[str, object] = {"deadline_s": 50.0}
    apply_deadline(state, Headers({"x-request-timeout": "10"}), options)
    assert options["deadline_s"] == 50.0 and state.deadline_applied == "50 (from the body's deadline_s)"
    options = {"deadline_s": None}
    apply_deadline(state, Headers({"x-stainless-read-timeout": "30"}), options)
    assert options["deadline_s"] == 29.0 and state.deadline_applied == "29 (from X-Stainless-Read-Timeout 30)"
    untouched: dict[str, object] = {"stream": object()}
    apply_deadline(SimpleNamespace(), Headers({"x-stainless-read-timeout": "30"}), untouched)
    assert "deadline_s" not in untouched
