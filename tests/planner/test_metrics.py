"""Run summaries: what they compute over all requests at once against each request's own figures."""

from __future__ import annotations

from hypothesis import given, strategies as st
import numpy as np
import pytest

from engine.core.metrics import RequestMetrics
from planner.metrics import inter_token_gaps

# Gaps between deliveries; 0.0 makes tokens delivered together (accepted drafts, a multi-step group).
_DELIVERIES = st.lists(st.sampled_from([0.0, 0.0, 1e-3, 0.013, 0.25]), min_size=0, max_size=30)


def _request(i: int, start_s: float, gaps: list[float]) -> RequestMetrics:
    times = np.cumsum([start_s, *gaps]).tolist()
    return RequestMetrics.from_token_times(f"r{i}", 0.0, 10, times, times[-1])


@given(st.lists(st.tuples(st.floats(0.0, 100.0), _DELIVERIES), min_size=1, max_size=20))
def test_the_runs_itls_are_each_requests_itls_in_order(requests: list[tuple[float, list[float]]]) -> None:
    """No gap between one request's last token and the next request's first, none of 0 between tokens
    delivered together: exactly each request's itl_s, one after another."""
    reqs = [_request(i, start, gaps) for i, (start, gaps) in enumerate(requests)]
    expected = [gap for r in reqs for gap in r.itl_s]
    assert inter_token_gaps(reqs).tolist() == expected
    assert all(len(r.itl_s) == sum(g != 0.0 for g in gaps) for r, (_, gaps) in zip(reqs, requests, strict=True))


@given(st.lists(st.tuples(st.floats(0.0, 100.0), _DELIVERIES), min_size=1, max_size=20), st.integers(2, 4))
def test_silent_leading_tokens_arrive_with_the_next_event(requests: list[tuple[float, list[float]]],
                                                         silent: int) -> None:
    """Tokens 2..silent of a request (but its last) stream no event: the client's gaps are those of the
    token times left, request by request (a harmony response's channel header under vLLM)."""
    reqs = [_request(i, start, gaps) for i, (start, gaps) in enumerate(requests)]
    expected = []
    for r in reqs:
        times = [t for k, t in enumerate(r.token_times) if not (1 <= k < silent and k < len(r.token_times) - 1)]
        expected += [b - a for a, b in zip(times, times[1:]) if b - a != 0.0]
    assert inter_token_gaps(reqs, silent).tolist() == pytest.approx(expected, rel=1e-12)


def test_a_four_token_harmony_response_shows_gaps_of_two_steps_then_one() -> None:
    """The published 4-token gpt-oss runs: a mean ITL of 1.5 steps where TPOT is 1 (vLLM, 2 silent tokens)."""
    reqs = [_request(0, 0.0, [0.01, 0.01, 0.01])]
    assert inter_token_gaps(reqs, 2).tolist() == pytest.approx([0.02, 0.01])
    assert inter_token_gaps(reqs, 0).tolist() == pytest.approx([0.01, 0.01, 0.01])
