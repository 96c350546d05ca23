"""Workloads: deterministic draws, distribution shapes, arrivals, prefix sharing, traces, presets."""

import json
import tracemalloc

from hypothesis import given, settings, strategies as st
import numpy as np
import pytest
from pydantic import ValidationError

from engine import limits
from engine.core.kv_cache_manager import hash_block_tokens
from engine.errors import InputError
from planner.playback import Replay, private_requests
from planner.workload import (
    PRESETS,
    ClosedLoopArrivals,
    ConstantArrivals,
    Conversation,
    EmpiricalLength,
    FixedLength,
    GammaArrivals,
    LognormalLength,
    NormalLength,
    PoissonArrivals,
    SharedPrefix,
    TimeVaryingArrivals,
    UniformLength,
    Workload,
    build_prompt,
    draw,
    follow_ups,
    get_workload,
    load_trace,
    summary,
)


def wl(**kw) -> Workload:
    base = dict(arrival=PoissonArrivals(rate_per_s=10), input_tokens=100, output_tokens=50, num_requests=200)
    return Workload(**{**base, **kw})


def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


# --------------------------------------------------------------------------- determinism


def test_same_seed_same_requests_and_different_seed_different() -> None:
    w = wl(input_tokens=UniformLength(min_tokens=10, max_tokens=500), seed=7)
    assert draw(w) == draw(w)
    other = draw(w.model_copy(update={"seed": 8}))
    assert [r.prompt_token_ids for r in other] != [r.prompt_token_ids for r in draw(w)]


def test_changing_the_rate_leaves_lengths_and_tokens_alone() -> None:
    slow = draw(wl(input_tokens=UniformLength(min_tokens=10, max_tokens=500)))
    fast = draw(wl(input_tokens=UniformLength(min_tokens=10, max_tokens=500), arrival=PoissonArrivals(rate_per_s=99)))
    assert [r.prompt_token_ids for r in slow] == [r.prompt_token_ids for r in fast]
    assert [r.arrival_s for r in slow] != [r.arrival_s for r in fast]


def test_token_ids_stay_in_range_and_respect_a_small_model_vocab() -> None:
    reqs = draw(wl(), vocab_size=2000)
    ids = np.concatenate([r.prompt_token_ids for r in reqs])
    assert ids.min() >= 1000 and ids.max() < 2000
    with pytest.raises(InputError, match="vocab_size"):
        draw(wl(), vocab_size=500)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32), lo=st.integers(1, 50), span=st.integers(0, 50), n=st.integers(1, 30),
       turns=st.integers(1, 3), share=st.floats(0, 1))
def test_any_draw_is_well_formed(seed: int, lo: int, span: int, n: int, turns: int, share: float) -> None:
    w = wl(seed=seed, num_requests=n, input_tokens=UniformLength(min_tokens=lo, max_tokens=lo + span),
           shared_prefix=SharedPrefix(num_prefixes=2, prefix_tokens=8, share=share),
           conversation=Conversation(min_turns=1, max_turns=turns))
    reqs = draw(w)
    assert len(reqs) == n and len({r.request_id for r in reqs}) == n
    for r in reqs:
        own = r.new_prompt_token_ids if r.is_follow_up else r.prompt_token_ids[8 if r.prefix_id is not None else 0:]
        assert lo <= len(own) <= lo + span and r.output_tokens == 50
        assert bool(r.prompt_token_ids) != bool(r.new_prompt_token_ids)
    times = [r.arrival_s for r in reqs if r.arrival_s is not None]
    assert times == sorted(times)


# --------------------------------------------------------------------------- lengths


def test_length_distributions_match_their_parameters() -> None:
    n = 20_000
    assert set(FixedLength(tokens=42).draw(rng(), n)) == {42}
    u = UniformLength(min_tokens=10, max_tokens=30).draw(rng(), n)
    assert u.min() == 10 and u.max() == 30 and u.mean() == pytest.approx(20, rel=0.02)
    g = NormalLength(mean_tokens=500, std_tokens=50, max_tokens=10_000).draw(rng(), n)
    assert g.mean() == pytest.approx(500, rel=0.01) and g.std() == pytest.approx(50, rel=0.05)
    ln = LognormalLength(median_tokens=300, sigma=1.0, max_tokens=10**6).draw(rng(), n)
    assert np.median(ln) == pytest.approx(300, rel=0.05)
    e = EmpiricalLength(tokens=[10, 100], weights=[3, 1]).draw(rng(), n)
    assert set(e) == {10, 100} and (e == 10).mean() == pytest.approx(0.75, abs=0.02)


def test_clipping_is_part_of_the_spec() -> None:
    d = LognormalLength(median_tokens=1000, sigma=2.0, min_tokens=100, max_tokens=2000).draw(rng(), 5000)
    assert d.min() == 100 and d.max() == 2000
    assert NormalLength(mean_tokens=5, std_tokens=50, max_tokens=10).draw(rng(), 1000).min() == 1


def test_length_spec_errors_and_int_shorthand() -> None:
    with pytest.raises(ValidationError, match="min_tokens"):
        UniformLength(min_tokens=10, max_tokens=5)
    with pytest.raises(ValidationError, match="weights"):
        EmpiricalLength(tokens=[1, 2], weights=[1.0])
    assert wl(input_tokens=64).input_tokens == FixedLength(tokens=64)
    assert Workload.model_validate(
        {"arrival": {"kind": "gamma", "rate_per_s": 2, "cv": 3}, "input_tokens": {"kind": "fixed", "tokens": 5},
         "output_tokens": 5, "num_requests": 1}).arrival == GammaArrivals(rate_per_s=2, cv=3)


# --------------------------------------------------------------------------- arrivals


def gaps(arrival, n: int = 20_000) -> np.ndarray:
    return np.diff(np.concatenate(([0.0], arrival.times(rng(), n))))


def test_poisson_mean_gap_is_one_over_rate() -> None:
    g = gaps(PoissonArrivals(rate_per_s=5))
    assert g.mean() == pytest.approx(0.2, rel=0.03) and g.std() / g.mean() == pytest.approx(1, rel=0.05)


@pytest.mark.parametrize("cv", [0.5, 1.0, 3.0])
def test_gamma_cv_and_rate(cv: float) -> None:
    g = gaps(GammaArrivals(rate_per_s=5, cv=cv))
    assert g.mean() == pytest.approx(0.2, rel=0.05) and g.std() / g.mean() == pytest.approx(cv, rel=0.08)


def test_constant_arrivals_are_evenly_spaced() -> None:
    assert np.allclose(gaps(ConstantArrivals(rate_per_s=4), 10), 0.25)


def test_time_varying_rate_per_segment_and_repeats() -> None:
    tv = TimeVaryingArrivals(segments=[{"duration_s": 100, "rate_per_s": 10}, {"duration_s": 100, "rate_per_s": 0},
                                       {"duration_s": 100, "rate_per_s": 2}])
    t = tv.times(rng(), 3000)
    assert np.all(np.diff(t) >= 0)
    first = t[t < 300]
    assert ((first < 100).sum()) == pytest.approx(1000, rel=0.1)
    assert ((first >= 100) & (first < 200)).sum() == 0
    assert ((first >= 200).sum()) == pytest.approx(200, rel=0.2)
    assert t.max() > 300  # the schedule repeats until enough requests arrived
    assert tv.offered_rate_per_s == pytest.approx(4)


@pytest.mark.parametrize("bad", [
    {"kind": "poisson", "rate_per_s": 0}, {"kind": "gamma", "rate_per_s": -1, "cv": 1},
    {"kind": "constant", "rate_per_s": 0}, {"kind": "closed_loop", "concurrency": 0},
    {"kind": "time_varying", "segments": [{"duration_s": 5, "rate_per_s": 0}]},
    {"kind": "time_varying", "segments": [{"duration_s": 5, "rate_per_s": -1}]},
    # Expected arrivals a cycle that underflow (1e-310): every arrival would be at infinity.
    {"kind": "time_varying", "segments": [{"duration_s": 1e-300, "rate_per_s": 1e-10}]},
])
def test_bad_rates_are_validation_errors(bad: dict) -> None:
    with pytest.raises(ValidationError):
        Workload.model_validate({"arrival": bad, "input_tokens": 1, "output_tokens": 1, "num_requests": 1})


def test_closed_loop_requests_carry_no_arrival_time() -> None:
    reqs = draw(wl(arrival=ClosedLoopArrivals(concurrency=8, think_time_s=1.5), num_requests=20))
    assert all(r.arrival_s is None and r.think_time_s == 1.5 for r in reqs)
    assert summary(reqs).offered_rate_per_s is None


# --------------------------------------------------------------------------- sharing


def test_shared_prefixes_are_identical_within_a_group_and_differ_across_groups() -> None:
    sp = SharedPrefix(num_prefixes=3, prefix_tokens=64, share=0.5)
    reqs = draw(wl(shared_prefix=sp, num_requests=600))
    groups: dict[int, set] = {}
    for r in reqs:
        if r.prefix_id is not None:
            groups.setdefault(r.prefix_id, set()).add(r.prompt_token_ids[:64])
    assert sorted(groups) == [0, 1, 2] and all(len(g) == 1 for g in groups.values())
    assert len({next(iter(g)) for g in groups.values()}) == 3
    share = sum(r.prefix_id is not None for r in reqs) / len(reqs)
    assert share == pytest.approx(0.5, abs=0.07)
    assert all(len(r.prompt_token_ids) == 100 + 64 * (r.prefix_id is not None) for r in reqs)


def test_theoretical_prefix_share() -> None:
    reqs = draw(wl(shared_prefix=SharedPrefix(num_prefixes=2, prefix_tokens=300, share=1.0), num_requests=50))
    assert summary(reqs).prefix_share == pytest.approx(300 / 400, abs=0.001)
    assert summary(reqs, prefix_tokens={0: 300, 1: 300}).prefix_share == pytest.approx(0.75)
    assert summary(draw(wl())).prefix_share == 0


def test_engine_block_hashing_shares_exactly_the_prefix_blocks() -> None:
    reqs = draw(wl(shared_prefix=SharedPrefix(num_prefixes=2, prefix_tokens=64, share=1.0), num_requests=30))
    seen, hits, bs = set(), 0, 16
    for r in reqs:
        parent = 0
        for i in range(len(r.prompt_token_ids) // bs):
            h = hash_block_tokens(parent, r.prompt_token_ids[i * bs : (i + 1) * bs], None)
            hits += h in seen
            seen.add(h)
            parent = h
    assert hits == (30 - 2) * 64 // bs  # all but each group's first request reuse the 4 prefix blocks


def test_zipf_popularity_favours_the_first_prefix() -> None:
    sp = SharedPrefix(num_prefixes=5, prefix_tokens=8, share=1.0, popularity="zipf", zipf_exponent=1.5)
    ids = [r.prefix_id for r in draw(wl(shared_prefix=sp, num_requests=2000))]
    counts = np.bincount(ids, minlength=5)
    assert list(counts) == sorted(counts, reverse=True)


def test_conversations_chain_turns_through_parents() -> None:
    conv = Conversation(min_turns=2, max_turns=4, think_time_s=3.0)
    w = wl(conversation=conv, num_requests=100, shared_prefix=SharedPrefix(num_prefixes=1, prefix_tokens=16, share=1))
    reqs = draw(w)
    assert len(reqs) == 100
    children = follow_ups(reqs)
    for r in reqs:
        if r.turn == 0:
            assert r.arrival_s is not None and r.parent_id is None and len(r.prompt_token_ids) == 116
        else:
            assert r.arrival_s is None and r.prompt_token_ids == () and len(r.new_prompt_token_ids) == 100
            assert r.think_time_s == 3.0 and children[r.parent_id] is r
    by_id = {r.request_id: r for r in reqs}
    assert all(by_id[r.parent_id].conversation_id == r.conversation_id for r in reqs if r.parent_id)
    turns = np.bincount([r.conversation_id for r in reqs])
    assert turns[:-1].min() >= 2 and turns.max() <= 4  # the last conversation may be cut at num_requests
    assert build_prompt([1, 2], (3,), [4, 5]) == [1, 2, 3, 4, 5]


# --------------------------------------------------------------------------- traces


def test_load_jsonl_trace_sorts_and_shares_prefixes(tmp_path) -> None:
    rows = [{"arrival_s": 1.0, "input_tokens": 100, "output_tokens": 5, "prefix_id": "sys"},
            {"arrival_s": 0.5, "input_tokens": 40, "output_tokens": 7, "prefix_id": "sys"},
            {"arrival_s": 2.0, "input_tokens": 30, "output_tokens": 9}]
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    reqs = load_trace(p)
    assert [r.arrival_s for r in reqs] == [0.5, 1.0, 2.0]
    assert [r.request_id for r in reqs] == ["t-L2", "t-L1", "t-L3"]
    assert [len(r.prompt_token_ids) for r in reqs] == [40, 100, 30]
    assert reqs[0].prompt_token_ids[:20] == reqs[1].prompt_token_ids[:20]  # half the shorter prompt
    assert reqs[0].prompt_token_ids[20] != reqs[1].prompt_token_ids[20]
    assert reqs[0].prefix_id == reqs[1].prefix_id == 0 and reqs[2].prefix_id is None
    fixed = load_trace(p, prefix_tokens=60)
    assert fixed[0].prompt_token_ids == fixed[1].prompt_token_ids[:40]


def test_load_csv_trace_with_conversations(tmp_path) -> None:
    p = tmp_path / "t.csv"
    p.write_text("arrival_s,input_tokens,output_tokens,prefix_id,conversation_id\n"
                 "0,30,10,,\n1,50,10,,c1\n2,120,10,,c1\n3,40,10,,c2\n")
    reqs = load_trace(p)
    assert [r.output_tokens for r in reqs] == [10] * 4
    assert reqs[2].prompt_token_ids[:50] == reqs[1].prompt_token_ids
    assert [r.turn for r in reqs] == [0, 0, 1, 0]
    assert [r.conversation_id for r in reqs] == [None, 0, 0, 1]


def test_trace_token_ids_fit_a_small_vocabulary(tmp_path) -> None:
    """A trace's ids started at 1000 whatever the model, so a byte-level model could not replay one."""
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps({"arrival_s": i, "input_tokens": 400, "output_tokens": 2, "prefix_id": "sys"})
                         + "\n" for i in range(4)))
    for vocab_size in (256, 20):
        ids = {i for r in Replay.from_trace(p, vocab_size=vocab_size).requests for i in r.prompt_token_ids}
        assert max(ids) < vocab_size and len(ids) > vocab_size * 0.8  # most of the vocabulary, not a corner
    assert min(i for r in load_trace(p) for i in r.prompt_token_ids) >= 1000  # a large vocabulary: as before


@pytest.mark.parametrize("content, where, field", [
    ('{"arrival_s": 0, "input_tokens": 5, "output_tokens": 1}\n{"arrival_s": 1, "input_tokens": -3, '
     '"output_tokens": 1}\n', ":2: ", "input_tokens"),
    ('{"arrival_s": 0, "input_tokens": 5, "output_tokens": 0}\n', ":1: ", "output_tokens"),
    ('{"arrival_s": 0, "input_tokens": 5, "output_tokens": 1}\n\n{"arrival_s": 1, "input_tokens": 5\n', ":3'", ""),
    ('{"arrival_s": "soon", "input_tokens": 5, "output_tokens": 1}\n', ":1: ", "arrival_s"),
    ('{"arrival_s": 0, "input_tokens": 2.5, "output_tokens": 1}\n', ":1: ", "input_tokens"),
    ('{"arrival_s": 0, "output_tokens": 1}\n', ":1: ", "input_tokens"),
    ('{"arrival": 0, "input_tokens": 5, "output_tokens": 1}\n', ":1: ", "fields"),
])
def test_trace_errors_name_file_line_and_field(tmp_path, content: str, where: str, field: str) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text(content)
    with pytest.raises(InputError) as exc:
        load_trace(p)
    assert f"bad.jsonl{where}{field + '=' if field else ''}" in str(exc.value)


def test_csv_errors_name_the_line_and_empty_traces_are_errors(tmp_path) -> None:
    p = tmp_path / "bad.csv"
    p.write_text("arrival_s,input_tokens,output_tokens\n0,5,1\n1,x,1\n")
    with pytest.raises(InputError, match=r"bad.csv:3: input_tokens='x'"):
        load_trace(p)
    for name, text in [("e.jsonl", "\n\n"), ("e.csv", "arrival_s,input_tokens,output_tokens\n")]:
        (tmp_path / name).write_text(text)
        with pytest.raises(InputError, match="no requests"):
            load_trace(tmp_path / name)
    with pytest.raises(InputError, match="missing.jsonl.* no such file"):
        load_trace(tmp_path / "missing.jsonl")


# --------------------------------------------------------------------------- presets


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_draws(name: str) -> None:
    w = get_workload(name, num_requests=40)
    reqs = draw(w)
    assert len(reqs) == 40 and w.description
    s = summary(reqs)
    assert s.input_tokens.mean > 0 and s.output_tokens.mean > 0


def test_preset_shapes() -> None:
    rag = summary(draw(get_workload("rag", num_requests=200)))
    assert 4000 <= rag.input_tokens.p50 <= 8000 and 200 <= rag.output_tokens.p50 <= 300
    reasoning = summary(draw(get_workload("reasoning", num_requests=400)))
    assert 1500 <= reasoning.output_tokens.p50 <= 2500 and reasoning.output_tokens.max <= 16384
    agent = draw(get_workload("code-agent", num_requests=200))
    assert summary(agent).prefix_share > 0.5 and any(r.is_follow_up for r in agent)
    assert all(r.arrival_s is None for r in draw(get_workload("batch", num_requests=10)))


def test_unknown_preset_suggests_close_names_and_overrides_are_validated(tmp_path) -> None:
    with pytest.raises(InputError, match="did you mean chat"):
        get_workload("chatt")
    with pytest.raises(InputError, match="num_requests"):
        get_workload("chat", num_requests=0)
    with pytest.raises(InputError, match="bogus"):
        get_workload("chat", bogus=1)
    f = tmp_path / "w.yaml"
    f.write_text("name: mine\narrival: {kind: constant, rate_per_s: 2}\ninput_tokens: 8\noutput_tokens: 4\n"
                 "num_requests: 3\n")
    assert [r.arrival_s for r in draw(get_workload(str(f)))] == [0.5, 1.0, 1.5]


# --------------------------------------------------------------------------- limits (issue 14)


def _peak_bytes(fn) -> tuple[BaseException | None, int]:
    """What fn raised, and the peak Python memory it allocated on the way."""
    tracemalloc.start()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 (returned for the test to inspect)
        return exc, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return None, 0


def test_a_request_beyond_the_context_is_refused_before_any_token_is_drawn() -> None:
    # 1,000 prompts of 1M tokens: 1e9 token ids (tens of GB) if drawn before the context check.
    w = wl(input_tokens=1_000_000, num_requests=1000)
    exc, peak = _peak_bytes(lambda: draw(w, max_model_len=131_072))
    assert isinstance(exc, InputError) and "custom-0" in str(exc) and "max_model_len=131072" in str(exc)
    assert peak < 20 * 2**20


def test_drawn_token_ids_cost_their_pointers_not_an_int_each() -> None:
    """Ids below the pool's bound are shared int objects: a million drawn ids hold ~8 bytes each (a
    tuple's pointer), not the ~40 of an int of their own, and their values are the draw's."""
    w = wl(input_tokens=500, num_requests=2000)
    tracemalloc.start()
    try:
        reqs = draw(w)
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    num_ids = sum(len(r.prompt_token_ids) for r in reqs)
    assert num_ids == 1_000_000 and held / num_ids < 16
    assert [r.prompt_token_ids for r in reqs] == [r.prompt_token_ids for r in draw(w)]


def test_conversation_history_counts_towards_the_context() -> None:
    conv = Conversation(min_turns=3, max_turns=3)
    w = wl(input_tokens=100, output_tokens=50, conversation=conv, num_requests=3,
           shared_prefix=SharedPrefix(num_prefixes=1, prefix_tokens=10, share=1))
    draw(w, max_model_len=10 + 3 * 150)  # the third turn holds the prefix and all three exchanges
    with pytest.raises(InputError, match=r"custom-2.*410 prompt \+ 50 output"):
        draw(w, max_model_len=10 + 3 * 150 - 1)


@pytest.mark.parametrize("changes", [
    {"input_tokens": 10_000_000, "num_requests": 1000},
    {"input_tokens": 100, "output_tokens": 10_000_000, "num_requests": 10},
    {"shared_prefix": SharedPrefix(num_prefixes=100_000, prefix_tokens=10_000_000, share=0.5)},
])
def test_a_workload_over_the_token_limit_is_refused_before_drawing(changes: dict) -> None:
    exc, peak = _peak_bytes(lambda: draw(wl(**changes)))
    assert isinstance(exc, InputError) and "MAX_WORKLOAD_TOKENS" in str(exc), exc
    assert "num_requests" in str(exc)
    assert peak < 20 * 2**20


def test_num_requests_over_the_limit_is_a_validation_error(tmp_path) -> None:
    path = tmp_path / "w.yaml"
    path.write_text("arrival: {kind: poisson, rate_per_s: 1}\ninput_tokens: 10\noutput_tokens: 10\n"
                    "num_requests: 10000000\n")
    with pytest.raises(InputError, match="num_requests=10000000.*1000000"):
        get_workload(str(path))


def test_arrivals_beyond_the_time_limit_are_refused() -> None:
    with pytest.raises(InputError, match="MAX_ARRIVAL_S"):
        draw(wl(arrival=PoissonArrivals(rate_per_s=1e-30), num_requests=3))


class _CountingRng:
    """A numpy Generator that fails the test after `budget` draws: an endless loop of draws
    becomes a failure instead of a hang."""

    def __init__(self, budget: int) -> None:
        self._rng, self.calls, self._budget = rng(), 0, budget

    def __getattr__(self, name: str):
        method = getattr(self._rng, name)

        def counted(*args, **kwargs):
            self.calls += 1
            if self.calls > self._budget:
                raise AssertionError(f"more than {self._budget} random draws")
            return method(*args, **kwargs)

        return counted


def test_time_varying_with_a_long_idle_segment_draws_a_bounded_number_of_times() -> None:
    # 116 days without traffic, then 1 ms at 1 request/s: one arrival per 300 years on average.
    tv = TimeVaryingArrivals(segments=[{"duration_s": 1e7, "rate_per_s": 0}, {"duration_s": 1e-3, "rate_per_s": 1}])
    counting = _CountingRng(budget=100)
    t = tv.times(counting, 5)  # type: ignore[arg-type]
    assert len(t) == 5 and np.all(np.diff(t) >= 0)
    period = 1e7 + 1e-3
    assert np.all(np.mod(t, period) >= 1e7)  # every arrival falls in the busy millisecond
    with pytest.raises(InputError, match="MAX_ARRIVAL_S"):
        draw(wl(arrival=tv, num_requests=5))


def test_time_varying_counts_per_segment_are_poisson() -> None:
    tv = TimeVaryingArrivals(segments=[{"duration_s": 10, "rate_per_s": 4}, {"duration_s": 10, "rate_per_s": 0},
                                       {"duration_s": 5, "rate_per_s": 2}])
    t = tv.times(rng(), 200_000)
    phase, cycles = np.mod(t, 25.0), t[-1] // 25.0
    busy, idle, slow = (phase < 10).sum(), ((phase >= 10) & (phase < 20)).sum(), (phase >= 20).sum()
    assert idle == 0
    assert busy / cycles == pytest.approx(40, rel=0.02) and slow / cycles == pytest.approx(10, rel=0.03)


def test_empirical_weights_must_be_finite() -> None:
    with pytest.raises(ValidationError):
        EmpiricalLength(tokens=[1, 2], weights=[1, float("inf")])


# --------------------------------------------------------------------------- trace correctness and limits


def test_a_csv_with_a_byte_order_mark_is_read(tmp_path) -> None:
    p = tmp_path / "bom.csv"
    p.write_bytes(b"\xef\xbb\xbfarrival_s,input_tokens,output_tokens\r\n0,5,1\r\n1.5,7,2\r\n")
    reqs = load_trace(p)
    assert [(r.arrival_s, len(r.prompt_token_ids), r.output_tokens) for r in reqs] == [(0, 5, 1), (1.5, 7, 2)]


@pytest.mark.parametrize("text, match", [
    ("arrival_s,input_tokens,output_tokens\n0,5,1\n1,5,1,99\n", r"bad.csv:3: row='4 values'.*3 columns"),
    ("arrival_s,input_tokens,output_tokens\n0,5\n", r"bad.csv:2: row='2 values'.*3 columns"),
    ("arrival_s,input_tokens,input_tokens,output_tokens\n0,5,6,1\n", r"bad.csv:1: columns=\['input_tokens'\].*once"),
    ("arrival_s,input_tokens,output_tokens\n1e300,5,1\n", r"bad.csv:2: arrival_s='1e300'.*MAX_ARRIVAL_S"),
    ("arrival_s,input_tokens,output_tokens\nnan,5,1\n", r"bad.csv:2: arrival_s='nan'.*finite"),
    ("arrival_s,input_tokens,output_tokens\n0,1e9,1\n", r"bad.csv:2: input_tokens='1e9'.*MAX_REQUEST_TOKENS"),
    ("arrival_s,input_tokens,output_tokens\n0,5,inf\n", r"bad.csv:2: output_tokens='inf'.*finite"),
])
def test_bad_csv_rows_are_refused_with_file_and_line(tmp_path, text: str, match: str) -> None:
    p = tmp_path / "bad.csv"
    p.write_text(text)
    with pytest.raises(InputError, match=match):
        load_trace(p)


@pytest.mark.parametrize("row, match", [
    ('{"arrival_s": 1e300, "input_tokens": 5, "output_tokens": 1}', "arrival_s=1e.300.*MAX_ARRIVAL_S"),
    ('{"arrival_s": NaN, "input_tokens": 5, "output_tokens": 1}', "arrival_s=nan.*finite"),
    ('{"arrival_s": 0, "input_tokens": 1e9, "output_tokens": 1}', "input_tokens=1000000000.0.*MAX_REQUEST_TOKENS"),
    ('{"arrival_s": 0, "input_tokens": Infinity, "output_tokens": 1}', "input_tokens=inf.*finite"),
    ('{"arrival_s": 0, "input_tokens": 1' + "0" * 5000 + ', "output_tokens": 1}', "too long"),
    ('{"arrival_s": 0, "input_tokens": ' + "[" * 5000 + "]" * 5000 + ', "output_tokens": 1}', "MAX_NESTING_DEPTH"),
    # Ids are texts or integers; a structure was printed into the id (found by bench/hostile_inputs.py).
    ('{"arrival_s": 0, "input_tokens": 5, "output_tokens": 1, "prefix_id": [1, 2]}', "prefix_id=.*a text or an integer"),
    ('{"arrival_s": 0, "input_tokens": 5, "output_tokens": 1, "conversation_id": {"a": 1}}', "conversation_id=.*integer id"),
])
def test_bad_jsonl_values_are_refused(tmp_path, row: str, match: str) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text(row + "\n")
    with pytest.raises(InputError, match=match):
        load_trace(p)


def test_trace_rows_beyond_the_limit_are_refused_while_streaming(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(limits, "MAX_REQUESTS", 3)
    p = tmp_path / "long.jsonl"
    # Line 5 is not JSON: the row limit must trip at line 4, before the reader gets there.
    p.write_text('{"arrival_s": 0, "input_tokens": 5, "output_tokens": 1}\n' * 4 + "not json\n")
    with pytest.raises(InputError, match=r"line 4.*MAX_REQUESTS=3"):
        load_trace(p)


def test_trace_tokens_beyond_the_limit_are_refused(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(limits, "MAX_WORKLOAD_TOKENS", 100)
    p = tmp_path / "t.csv"
    p.write_text("arrival_s,input_tokens,output_tokens\n" + "0,40,10\n" * 3)
    with pytest.raises(InputError, match=r"line 4, 150,.*MAX_WORKLOAD_TOKENS=100"):
        load_trace(p)


def test_a_trace_row_beyond_the_context_is_refused_before_drawing(tmp_path) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text('{"arrival_s": 0, "input_tokens": 5000000, "output_tokens": 1}\n')
    exc, peak = _peak_bytes(lambda: load_trace(p, max_model_len=4096))
    assert isinstance(exc, InputError) and "t-L1" in str(exc) and "max_model_len=4096" in str(exc)
    assert peak < 20 * 2**20


def test_a_trace_line_over_the_length_limit_is_refused(tmp_path) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text('{"arrival_s": 0, "input_tokens": 5, "output_tokens": 1, "prefix_id": "' + "x" * 70_000 + '"}\n')
    with pytest.raises(InputError, match="length of line 1.*MAX_LINE_BYTES"):
        load_trace(p)


def test_a_workload_copied_past_validation_is_still_held_to_the_request_limit() -> None:
    w = wl().model_copy(update={"num_requests": 10_000_000})  # model_copy does not validate
    exc, peak = _peak_bytes(lambda: draw(w))
    assert isinstance(exc, InputError) and "MAX_REQUESTS" in str(exc)
    assert peak < 20 * 2**20


def test_a_trace_prefix_is_drawn_no_longer_than_its_longest_prompt(tmp_path) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text('{"arrival_s": 0, "input_tokens": 50, "output_tokens": 1, "prefix_id": "sys"}\n'
                 '{"arrival_s": 1, "input_tokens": 80, "output_tokens": 1, "prefix_id": "sys"}\n')
    exc, peak = _peak_bytes(lambda: load_trace(p, prefix_tokens=10**9))  # 1e9 ids if drawn as asked
    assert exc is None and peak < 20 * 2**20
    reqs = load_trace(p, prefix_tokens=10**9)
    assert reqs[1].prompt_token_ids[:50] == reqs[0].prompt_token_ids


@pytest.mark.parametrize("name", ["a\nb", "red\x1b[31m", "tab\there"])
def test_a_workload_name_with_control_characters_is_refused(name: str) -> None:
    """The name is part of every request id and printed in tables: no forged lines or terminal escapes
    (accepted before; found by bench/hostile_inputs.py)."""
    with pytest.raises(ValidationError, match="must be printable"):
        wl(name=name)


# --------------------------------------------------------------------------- private blocks


def test_private_requests_are_those_no_other_prompt_can_share_a_block_with() -> None:
    """A request is private (engine Request.private_blocks) when no other prompt starts with its
    first block, nothing served before does, and no follow-up turn extends it; a prompt under a
    block has no first block to tell it apart (its first decoded block could match another's)."""
    w = wl(num_requests=60, input_tokens=UniformLength(min_tokens=4, max_tokens=60),
           shared_prefix=SharedPrefix(num_prefixes=2, prefix_tokens=20, share=0.5))
    replay = Replay.of(w)
    private = private_requests(replay, 16)
    for r in replay.requests:
        others = [o.prompt_token_ids[:16] for o in replay.requests if o is not r]
        shareable = len(r.prompt_token_ids) < 16 or r.prompt_token_ids[:16] in others
        assert (r.request_id in private) == (not shareable)
    assert private and not any(r.request_id in private for r in replay.requests if r.prefix_id is not None)
    # Something served before with a private request's first block makes it shareable.
    victim = next(r for r in replay.requests if r.request_id in private)
    assert victim.request_id not in private_requests(replay, 16, served=[victim.prompt_token_ids[:16] + (7,)])
    # A conversation's first turn is extended by its follow-ups; they are never private either.
    chats = Replay.of(wl(num_requests=30, conversation=Conversation(min_turns=1, max_turns=3)))
    with_follow_ups = set(follow_ups(chats.requests)) | {r.request_id for r in chats.requests if r.parent_id}
    assert not private_requests(chats, 16) & with_follow_ups
    assert private_requests(chats, 16)


def test_a_replay_says_whether_its_requests_lengths_vary() -> None:
    """One prompt length and one output length is 'fixed'; a spread on either side, a prefix only some
    prompts share, or follow-up turns (their prompts carry the history) is 'varied'."""
    fixed = wl(num_requests=20, input_tokens=FixedLength(tokens=64), output_tokens=FixedLength(tokens=16))
    assert Replay.of(fixed).lengths == "fixed"
    assert Replay.of(fixed.model_copy(update={"num_requests": 1})).lengths == "fixed"
    for update in ({"output_tokens": UniformLength(min_tokens=8, max_tokens=24)},
                   {"input_tokens": LognormalLength(median_tokens=64, sigma=0.5, max_tokens=512)},
                   {"shared_prefix": SharedPrefix(num_prefixes=1, prefix_tokens=32, share=0.5)},
                   {"conversation": Conversation(min_turns=2, max_turns=2)}):
        assert Replay.of(fixed.model_copy(update=update)).lengths == "varied", update
    # Every prompt behind the same prefix: still one length.
    shared = fixed.model_copy(update={"shared_prefix": SharedPrefix(num_prefixes=1, prefix_tokens=32, share=1.0)})
    assert Replay.of(shared).lengths == "fixed"
