"""A day of traffic over a fleet: the traffic file, the fleet simulation and its autoscaler.

Known answers: a fleet pinned at one replica is the ordinary simulator's one replica; a pinned
autoscaler is the fixed fleet; billing is replicas x time. Properties: nothing accepted is lost
when replicas drain; a step up in traffic adds replicas, which serve exactly load_s after the
decision; the same seed gives the same day. Sizes are in requests and simulated seconds only.
"""

from __future__ import annotations

import dataclasses
import math
import statistics

import pytest
import simpy

from engine import limits
from engine.catalog import resolve_model
from engine.core import Request, SamplingParams
from engine.errors import InputError
from planner.hardware import get_hardware
from planner.playback import Replay
from planner.sim.autoscaler import Autoscaler, AutoscalePolicy, ScalingRule
from planner.sim.fleet import Fleet, _Billing, HourTally, simulate_fleet, simulate_sampled_fleet
from planner.sim.simulator import ReplicaTemplate, simulate
from planner.specs import SLO, Deployment
from planner.traffic import TrafficDay, check_limits, load_traffic

MODEL = resolve_model("llama-3.1-8b")
HW = get_hardware("h100-sxm")
WORKLOAD = {"name": "w", "input_tokens": 200, "output_tokens": {"kind": "uniform", "min_tokens": 20, "max_tokens": 120}}
SLO_ = SLO.parse("ttft_p99_ms<=2000,tpot_p99_ms<=100")


@pytest.fixture(scope="module")
def template() -> ReplicaTemplate:
    return ReplicaTemplate.resolve(MODEL, HW, Deployment(hardware=HW.name))


def day(segments: list[tuple[float, float]], seed: int = 0, **fields: object) -> TrafficDay:
    """A traffic of (duration_s, rate_per_s) segments."""
    return TrafficDay.model_validate({
        "rate": {"kind": "time_varying", "segments": [{"duration_s": d, "rate_per_s": r} for d, r in segments]},
        "workload": WORKLOAD, "seed": seed, **fields})


def rule(**changes: object) -> ScalingRule:
    base = ScalingRule(min_replicas=1, max_replicas=6, initial_replicas=1, target_in_flight_per_replica=4.0,
                       scale_up_queue_per_replica=4.0, interval_s=5.0, window_s=10.0, scale_down_idle_s=20.0,
                       cooldown_s=10.0, load_s=30.0)
    return dataclasses.replace(base, **changes)


def run(template: ReplicaTemplate, d: TrafficDay, r: ScalingRule) -> tuple[object, dict[str, tuple[float, float, float]]]:
    seen: dict[str, tuple[float, float, float]] = {}

    def finished(request: Request) -> None:
        seen[request.request_id] = (request.arrival_time, request.first_token_time, request.finish_time)

    result = simulate_fleet(template, d.requests(MODEL.vocab_size, template.max_len), d.duration_s, r, SLO_,
                            on_finished=finished)
    return result, seen


# --------------------------------------------------------------------------- known answers


def test_one_pinned_replica_is_the_simulators_replica(template: ReplicaTemplate) -> None:
    d = day([(120.0, 3.0)])
    requests = list(d.requests(MODEL.vocab_size, template.max_len))
    fleet_run, seen = run(template, d, ScalingRule.pinned(1))
    result = simulate(MODEL, HW, Deployment(hardware=HW.name), Replay("w", requests, None, "the day's requests"))
    assert len(seen) == len(requests) == fleet_run.finished > 100
    for m in result.record.requests:
        arrival, first, finish = seen[m.request_id]
        assert arrival == m.arrival_time
        assert first - arrival == m.ttft_s
        assert finish - arrival == m.e2e_s


def test_pinned_autoscaler_is_the_fixed_fleet(template: ReplicaTemplate) -> None:
    # Thresholds that would scale at every decision, held by min = max: no action, same timings.
    d = day([(60.0, 6.0), (60.0, 0.5)])
    fixed, fixed_seen = run(template, d, ScalingRule.pinned(3))
    pinned, pinned_seen = run(template, d, rule(min_replicas=3, max_replicas=3, initial_replicas=3,
                                                target_in_flight_per_replica=0.01, scale_up_queue_per_replica=0.01,
                                                scale_down_idle_s=0.0, cooldown_s=0.0))
    assert pinned.actions == [] and pinned_seen == fixed_seen
    assert pinned.replica_s == fixed.replica_s == pytest.approx(3 * 120.0)


def test_billing_is_replicas_times_time() -> None:
    hours = [HourTally() for _ in range(3)]
    billing = _Billing(hours, end_s=10_800.0)
    billing.change(0.0, 2)
    billing.change(3000.0, 3)  # 5 from 3000 s
    billing.change(7500.0, -4)  # 1 from 7500 s
    billing.change(10_800.0, 0)
    assert [h.replica_s for h in hours] == [2 * 3000 + 5 * 600, 5 * 3600, 5 * 300 + 1 * 3300]
    assert billing.total_s == sum(h.replica_s for h in hours)
    billing.change(12_000.0, -1)  # after the day: not billed
    assert billing.total_s == sum(h.replica_s for h in hours)


# --------------------------------------------------------------------------- properties


def test_step_up_adds_replicas_that_serve_after_the_load_delay(template: ReplicaTemplate) -> None:
    load_s = 45.0
    d = day([(60.0, 1.0), (120.0, 20.0)])
    result, _ = run(template, d, rule(load_s=load_s))
    up = [(t, n) for t, n in result.actions if n > 0]
    assert up, "a twentyfold step in traffic added no replica"
    first_up_s = up[0][0]
    assert first_up_s > 60.0  # decided on traffic after the step
    # Ready counts change only when a load completes: the first rise is exactly load_s after the decision.
    rises = [t for (t, n), (_, before) in zip(result.ready[1:], result.ready) if n > before]
    assert rises[0] == pytest.approx(first_up_s + load_s)
    assert max(n for _, n in result.ready) > 1


def test_scale_down_drains_and_loses_nothing(template: ReplicaTemplate) -> None:
    # Busy, then nearly idle: replicas retire while requests are in flight on them.
    d = day([(90.0, 15.0), (90.0, 0.2)])
    result, seen = run(template, d, rule(min_replicas=1, max_replicas=4, initial_replicas=4, scale_down_idle_s=10.0,
                                         cooldown_s=0.0))
    assert any(n < 0 for _, n in result.actions)
    assert len(seen) == result.finished == sum(h.arrived for h in result.hours)  # every arrival finished


def test_a_retired_busy_replica_serves_everything_then_stops_billing(template: ReplicaTemplate) -> None:
    env = simpy.Environment()
    finished: dict[str, float] = {}
    fleet = Fleet(env, template, ScalingRule.pinned(2), "round_robin", _Billing([HourTally()], end_s=3600.0),
                  lambda r: finished.__setitem__(r.request_id, env.now))
    fleet.start(2)
    # Round robin: even ids to replica 0 (short replies), odd ids to replica 1 (long ones).
    for i in range(8):
        fleet.submit(Request(f"r{i}", list(range(1000, 1300)),
                             SamplingParams(max_tokens=50 if i % 2 == 0 else 400, ignore_eos=True), 0.0))
    retired_at = 0.2
    env.run(until=retired_at)
    assert [m.in_flight for m in fleet.ready] == [4, 4]  # both busy when one is retired
    fleet.retire(1)  # ties: the first, replica 0
    assert fleet.num_ready == 1
    env.run()
    assert sorted(finished) == [f"r{i}" for i in range(8)]  # nothing dropped
    drained_s = max(finished[f"r{i}"] for i in range(0, 8, 2))
    assert retired_at < drained_s < env.now
    fleet.billing.change(env.now, 0)
    # Replica 1 billed until the end, replica 0 until it had served its last request.
    assert fleet.billing.total_s == pytest.approx(env.now + drained_s)


def test_a_replica_retired_while_its_requests_are_on_their_way_drains(template: ReplicaTemplate) -> None:
    # Handled by the API server but not yet forwarded (its latency_s): the drain waits for them
    # to reach the engine instead of spinning at the moment of retirement.
    env = simpy.Environment()
    finished: list[str] = []
    fleet = Fleet(env, template, ScalingRule.pinned(2), "round_robin", _Billing([HourTally()], end_s=3600.0),
                  lambda r: finished.append(r.request_id))
    fleet._front_end_s, fleet._api_latency_s = 0.001, 0.05
    fleet.start(2)
    for i in range(2):
        fleet.submit(Request(f"r{i}", list(range(1000, 1100)), SamplingParams(max_tokens=5, ignore_eos=True), 0.0))
    env.run(until=0.01)  # both handled (0.001 s), neither forwarded yet (0.051 s)
    fleet.retire(1)
    for _ in range(10_000):
        if env.peek() == math.inf:
            break
        env.step()
    assert sorted(finished) == ["r0", "r1"]


def test_same_seed_same_day(template: ReplicaTemplate) -> None:
    d = day([(60.0, 2.0), (60.0, 12.0), (60.0, 1.0)], seed=7)
    a, a_seen = run(template, d, rule())
    b, b_seen = run(template, d, rule())
    assert a == b and a_seen == b_seen
    c, _ = run(template, day([(60.0, 2.0), (60.0, 12.0), (60.0, 1.0)], seed=8), rule())
    assert [h.arrived for h in c.hours] != [h.arrived for h in a.hours] or c.replica_s != a.replica_s


# --------------------------------------------------------------------------- a fleet sampled by stand-ins


def _means(run_: object) -> tuple[float, float, float, float]:
    """Arrivals, SLO attainment, mean TTFT and mean E2E over the day (hours' weighted tallies)."""
    arrived = sum(h.arrived for h in run_.hours)
    return (arrived, sum(h.good for h in run_.hours) / arrived, sum(h.ttft_s for h in run_.hours) / arrived,
            sum(h.e2e_s for h in run_.hours) / arrived)


def test_a_stand_in_takes_every_nth_arrival(template: ReplicaTemplate) -> None:
    # Round robin over n replicas hands each one every n-th arrival of the Poisson stream: gaps
    # with mean n / rate and a coefficient of variation 1 / sqrt(n) (Gamma(n)), not Poisson's 1.
    n, per_replica_s, seconds = 25, 0.5, 4000.0
    d = day([(seconds, n * per_replica_s)])
    arrivals: dict[str, list[float]] = {}

    def seen(request: Request) -> None:
        arrivals.setdefault(request.request_id.split("-")[1], []).append(request.arrival_time)

    result = simulate_sampled_fleet(template, d, ScalingRule.pinned(n), SLO_, stand_ins=2, vocab_size=MODEL.vocab_size,
                                    on_finished=seen)
    assert sorted(arrivals) == ["s0", "s1"] and result.finished == sum(map(len, arrivals.values()))
    for times in arrivals.values():
        gaps = [b - a for a, b in zip(sorted(times), sorted(times)[1:])]
        assert statistics.mean(gaps) == pytest.approx(1 / per_replica_s, rel=0.08)
        assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(1 / math.sqrt(n), rel=0.15)
    # Each stand-in request stands for n / 2 of the fleet's: the tallies estimate the fleet's arrivals.
    assert _means(result)[0] == pytest.approx(n * per_replica_s * seconds, rel=0.05)


def test_a_sampled_fixed_fleet_serves_as_the_whole_fleet(template: ReplicaTemplate) -> None:
    # Replicas behind round robin are exchangeable: three stand-ins of a fixed fleet of ten give
    # the whole fleet's day (its ~2,400 requests simulated one by one) within sampling error.
    d = day([(240.0, 10 * 10.0)])
    slo = SLO.parse("ttft_p99_ms<=24")  # between the median TTFT (22 ms) and its P90 (25 ms)
    whole = simulate_fleet(template, d.requests(MODEL.vocab_size, template.max_len), d.duration_s,
                           ScalingRule.pinned(10), slo)
    sampled = simulate_sampled_fleet(template, d, ScalingRule.pinned(10), slo, stand_ins=3, vocab_size=MODEL.vocab_size)
    assert sampled.finished < 0.4 * whole.finished  # three replicas' requests, not ten
    assert sampled.replica_s == whole.replica_s == pytest.approx(10 * 240.0)
    (n_w, good_w, ttft_w, e2e_w), (n_s, good_s, ttft_s, e2e_s) = _means(whole), _means(sampled)
    assert 0.05 < 1 - good_w < 0.95, "the SLO should separate requests"
    assert n_s == pytest.approx(n_w, rel=0.05)
    assert good_s == pytest.approx(good_w, abs=0.05)
    assert ttft_s == pytest.approx(ttft_w, rel=0.15)
    assert e2e_s == pytest.approx(e2e_w, rel=0.08)


def test_a_sampled_fleet_scales_and_loses_nothing(template: ReplicaTemplate) -> None:
    # The autoscaler reads the stand-ins' in-flight requests scaled to the fleet: a step up in
    # traffic adds replicas after the load delay, the way down retires them, every stand-in
    # request finishes, and the tallies' arrivals estimate the day's.
    d = day([(120.0, 8.0), (240.0, 60.0), (240.0, 8.0)])
    r = rule(max_replicas=20, initial_replicas=2, target_in_flight_per_replica=8.0, scale_down_idle_s=30.0)
    seen: list[str] = []
    result = simulate_sampled_fleet(template, d, r, SLO_, stand_ins=2, vocab_size=MODEL.vocab_size,
                                    on_finished=lambda request: seen.append(request.request_id))
    assert any(n > 0 for _, n in result.actions) and any(n < 0 for _, n in result.actions)
    assert max(n for _, n in result.ready) > 4
    assert len(seen) == len(set(seen)) == result.finished
    assert _means(result)[0] == pytest.approx(d.expected_requests, rel=0.1)


def test_changing_one_segment_leaves_the_others_requests() -> None:
    a = list(day([(60.0, 2.0), (60.0, 5.0)]).requests(MODEL.vocab_size))
    b = list(day([(60.0, 2.0), (60.0, 9.0)]).requests(MODEL.vocab_size))
    first = [r for r in a if r.arrival_s < 60.0]
    assert first and first == [r for r in b if r.arrival_s < 60.0]


def test_autoscaler_desired_count() -> None:
    class Fake:
        num_ready, num_active = 2, 3

    scaler = Autoscaler.__new__(Autoscaler)
    scaler.fleet, scaler.rule = Fake(), rule(min_replicas=1, max_replicas=6, target_in_flight_per_replica=4.0,
                                              scale_up_queue_per_replica=4.0)
    assert scaler.desired(in_flight=0.0, waiting=0.0) == 1  # min
    assert scaler.desired(in_flight=9.0, waiting=0.0) == 3  # ceil(9 / 4)
    assert scaler.desired(in_flight=4.0, waiting=9.0) == 4  # a queue past 4 per ready replica: one more than active
    assert scaler.desired(in_flight=100.0, waiting=0.0) == 6  # max


# --------------------------------------------------------------------------- the traffic file


def test_diurnal_curve_peaks_at_its_hour() -> None:
    d = TrafficDay.model_validate({"rate": {"kind": "diurnal", "peak_rate_per_s": 10, "trough_rate_per_s": 2,
                                            "peak_hour": 14, "step_s": 3600}, "workload": "chat"})
    rates = [s.rate_per_s for s in d.segments()]
    assert len(rates) == 24 and d.duration_s == 86_400
    assert max(rates) == rates[14] == pytest.approx(2 + 8 * (1 + math.cos(math.pi / 24)) / 2)  # held at 14:30
    assert rates[2] == min(rates)  # twelve hours from the peak
    assert d.expected_requests == pytest.approx(6 * 86_400)  # the cosine averages out over a day


@pytest.mark.parametrize(("text", "field"), [
    ("rate: {kind: hourly, rates_per_s: [1, -2]}\nworkload: chat", "rate.hourly.rates_per_s.1"),
    ("rate: {kind: diurnal, peak_rate_per_s: 1, trough_rate_per_s: 5}\nworkload: chat", "rate.diurnal.trough_rate_per_s"),
    ("rate: {kind: hourly, rates_per_s: [1]}\nworkload: chatt", "workload"),
    ("rate: {kind: hourly, rates_per_s: [1]}\nworkload: code-agent", "workload.conversation"),
    ("rate: {kind: hourly, rates_per_s: [1]}\nworkload: chat\nautoscaling: {min_replicas: 5, max_replicas: 2}",
     "autoscaling.min_replicas"),
    ("rate: {kind: hourly, rates_per_s: [1]}\nworkload: chat\nautoscaling: {cooldown: 5}", "autoscaling.cooldown"),
    ("rate: {kind: hourly, rates_per_s: [0, 0]}\nworkload: chat", "rate"),
    ("rate: {kind: time_varying, segments: [{duration_s: 700000, rate_per_s: 1}]}\nworkload: chat", "rate.segments"),
])
def test_bad_traffic_files_name_the_field(tmp_path, text: str, field: str) -> None:
    path = tmp_path / "day.yaml"
    path.write_text(text)
    with pytest.raises(InputError) as err:
        load_traffic(str(path))
    assert str(err.value).count("\n") == 0
    assert err.value.field.removeprefix("day.yaml: ").startswith(field), err.value.field


def test_request_limit_is_checked_before_anything_is_drawn(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "day.yaml"
    path.write_text("rate: {kind: diurnal, peak_rate_per_s: 1000, trough_rate_per_s: 100}\nworkload: chat")
    monkeypatch.setattr(limits, "MAX_TRAFFIC_REQUESTS", 1_000_000)
    d = load_traffic(str(path))  # ~47.5 million requests: a large fleet's stand-ins serve a share of them
    with pytest.raises(InputError, match="MAX_TRAFFIC_REQUESTS"):
        next(d.requests())  # ... a fleet simulated whole serves them all
    with pytest.raises(InputError, match="stand-ins' share"):
        check_limits(d, 0.05)
    check_limits(d, 0.02)
    monkeypatch.setattr(limits, "MAX_TRAFFIC_REQUESTS", 100)
    with pytest.raises(InputError, match="MAX_TRAFFIC_REQUESTS"):
        load_traffic(str(path))  # more than even the smallest share could serve


def test_policy_defaults_are_derived_where_unset() -> None:
    policy = AutoscalePolicy()
    assert policy.load_s is None and policy.target_in_flight_per_replica is None and policy.max_replicas is None
