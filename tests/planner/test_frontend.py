"""The API server in front of the engine: one request at a time, and requests going on to the engine
each as soon as handled, or together once their round is handled (vLLM's asyncio server)."""

from __future__ import annotations

import numpy as np
import pytest
import simpy

from engine.core import Request, SamplingParams
from planner.public.retime import _through_api, _through_api_in_rounds
from planner.sim.frontend import FrontEnd

HANDLE_S, LATENCY_S = 0.01, 0.005


def _reached(release: str, sends: list[float]) -> list[float]:
    """When each request, sent at `sends` (each by its own event), reaches the engine."""
    env = simpy.Environment()
    api = FrontEnd(env, HANDLE_S, LATENCY_S, release)  # type: ignore[arg-type]
    reached: dict[str, float] = {}

    def send(i: int, at: float):  # noqa: ANN202 (SimPy process)
        yield env.timeout(at)
        api.forward(Request(str(i), [1, 2, 3], SamplingParams(max_tokens=1), arrival_time=env.now),
                    lambda r: reached.__setitem__(r.request_id, env.now))

    for i, at in enumerate(sends):
        env.process(send(i, at))
    env.run()
    assert api.free_at == pytest.approx(max(reached.values()) - LATENCY_S)  # when the last one was handled
    return [reached[str(i)] for i in range(len(sends))]


def test_a_burst_goes_on_one_by_one_or_all_at_once() -> None:
    burst = [0.0] * 5
    # One by one: the k-th is handled k + 1 handling times after the burst.
    assert _reached("each", burst) == pytest.approx([(k + 1) * HANDLE_S + LATENCY_S for k in range(5)])
    # In rounds: the first request's event starts a round of its own; the other four wait and go on together.
    assert _reached("round", burst) == pytest.approx([HANDLE_S + LATENCY_S] + [5 * HANDLE_S + LATENCY_S] * 4)


def test_requests_the_server_is_free_for_go_on_alike() -> None:
    spaced = [0.0, 0.05, 0.1, 0.3]  # each one after the last was handled
    assert _reached("round", spaced) == pytest.approx(_reached("each", spaced))
    assert _reached("each", spaced) == pytest.approx([t + HANDLE_S + LATENCY_S for t in spaced])


def test_a_request_sent_during_a_round_waits_for_the_next() -> None:
    # Handled from 0 to 0.03; the one sent at 0.015 starts the next round at 0.03, with the one sent at 0.02.
    got = _reached("round", [0.0, 0.0, 0.0, 0.015, 0.02])
    assert got == pytest.approx([0.01 + LATENCY_S, 0.03 + LATENCY_S, 0.03 + LATENCY_S, 0.05 + LATENCY_S, 0.05 + LATENCY_S])


@pytest.mark.parametrize("release", ["each", "round"])
def test_re_timing_the_traced_rounds_gives_the_simulators_times(release: str) -> None:
    """The re-timing's closed forms, fed the traced arrivals at the engine, give them back."""
    rng = np.random.default_rng(0)
    sends = np.sort(np.concatenate([np.zeros(20), rng.uniform(0, 0.5, 40), np.full(10, 0.25)]))
    reached = np.array(_reached(release, sends.tolist())) - LATENCY_S
    through = _through_api_in_rounds if release == "round" else _through_api
    assert through(sends, HANDLE_S, reached) == pytest.approx(reached, rel=1e-12)
    # Rounds are what the traced arrivals show: fewer of them than requests, for the burst at 0.
    assert len(np.unique(reached)) < len(sends) if release == "round" else len(np.unique(reached)) == len(sends)
