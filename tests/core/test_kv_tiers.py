"""Offload tiers in the core: evicted prefix blocks go to host then disk and come back by hash;
swap preemption keeps a request's progress; external KV is listed for the runner. The
randomised runs of test_scheduler_properties check every context's KV through these paths."""

from __future__ import annotations

import pytest

from engine.core import BlockCopy, KVCacheManager, KVTiers, RequestStatus

from .testlib import FakeRunner, check_invariants, make_request, make_scheduler, run_to_completion, sample_all

BS = 4


def _serve(sched, request, runner: FakeRunner, now: float = 0.0) -> None:
    """Add `request` and run until everything has finished."""
    sched.add_request(request)
    run_to_completion(sched, now, runner=runner)


def test_an_evicted_prefix_comes_back_from_the_host_tier() -> None:
    # 4 device blocks: serving b (12 tokens) must evict a's cached 3-block prefix.
    sched = make_scheduler(num_blocks=4, block_size=BS, host_blocks=8)
    runner = FakeRunner(sched)
    shared = list(range(100, 112))
    _serve(sched, make_request("a", shared + [1], max_tokens=1), runner)
    _serve(sched, make_request("b", 13, max_tokens=1), runner)  # its own 13 tokens push a's blocks out
    assert sched.kv_cache_manager.tiers.host.num_cached == 3
    c = make_request("c", shared + [2], max_tokens=1)
    sched.add_request(c)
    out = sched.schedule(10.0)
    copies = out.kv_transfers.copies
    # b's cached blocks go to the host as c's new blocks reuse them, and a's come back.
    assert [(x.src, x.dst) for x in copies if x.dst == "device"] == [("host", "device")] * 3
    assert c.num_computed_tokens == 12 and c.num_cached_tokens == 12
    runner.execute(out)  # the fake runner checks c's whole context reads back right
    stats = sched.kv_cache_manager.prefix_cache_stats
    assert stats.host_hit_tokens == 12 and stats.hit_tokens == 0
    assert stats.hit_rate == 12 / (13 + 13 + 13)


def test_without_a_tier_the_same_prefix_is_recomputed() -> None:
    sched = make_scheduler(num_blocks=4, block_size=BS)
    runner = FakeRunner(sched)
    shared = list(range(100, 112))
    _serve(sched, make_request("a", shared + [1], max_tokens=1), runner)
    _serve(sched, make_request("b", 13, max_tokens=1), runner)
    c = make_request("c", shared + [2], max_tokens=1)
    sched.add_request(c)
    out = sched.schedule(10.0)
    assert out.kv_transfers is None and c.num_computed_tokens == 0


def test_the_host_tier_demotes_its_least_recent_block_to_disk() -> None:
    tiers = KVTiers(host_blocks=2, disk_blocks=2)
    kv = KVCacheManager(8, BS)
    hashes = []
    for i in range(3):
        r = make_request(f"r{i}", 5)
        kv.get_computed_blocks(r)  # hashes its full block
        hashes.append(r.block_hashes[0])
    assert tiers.offload(hashes[0], 10) == [BlockCopy("device", 10, "host", 0)]
    assert tiers.offload(hashes[1], 11) == [BlockCopy("device", 11, "host", 1)]
    # The host is full: its least recently used block (hashes[0], slot 0) goes to disk first.
    assert tiers.offload(hashes[2], 12) == [BlockCopy("host", 0, "disk", 0), BlockCopy("device", 12, "host", 0)]
    assert [tiers.lookup(x) for x in hashes] == ["disk", "host", "host"]
    assert tiers.stats.stored_blocks == 3 and tiers.stats.demoted_blocks == 1


def test_a_slot_read_this_step_is_not_overwritten_until_the_next() -> None:
    kv = KVCacheManager(8, BS)
    r = make_request("r", 9)
    kv.get_computed_blocks(r)
    tiers = KVTiers(host_blocks=1)
    tiers.offload(r.block_hashes[0], 3)
    [slot] = tiers.pin([(r.block_hashes[0], "host")])
    assert tiers.offload(r.block_hashes[1], 4) == []  # the only slot is being read: the block is dropped
    tiers.begin_step()
    assert tiers.offload(r.block_hashes[1], 4) == [BlockCopy("device", 4, "host", slot)]


def test_swap_preemption_keeps_progress_and_resumes_by_copy() -> None:
    # Two requests that cannot both grow in 6 blocks: the later one is preempted.
    sched = make_scheduler(num_blocks=6, block_size=BS, max_model_len=32, preemption_mode="swap", host_blocks=16)
    a, b = make_request("a", 8, max_tokens=12), make_request("b", 8, max_tokens=12)
    sched.add_request(a)
    sched.add_request(b)
    runner = FakeRunner(sched)
    now, computed_at_preemption = 0.0, None
    while sched.has_unfinished_requests():
        out = sched.schedule(now)
        check_invariants(sched, out)
        runner.execute(out)
        if out.preempted_request_ids and computed_at_preemption is None:
            assert out.preempted_request_ids == ("b",)
            assert b.status is RequestStatus.PREEMPTED and sched.kv_cache_manager.is_swapped(b)
            computed_at_preemption = b.num_computed_tokens
            assert computed_at_preemption > 8  # it keeps its prompt and what it decoded
            assert {(c.src, c.dst) for c in out.kv_transfers.copies} == {("device", "host")}
        for s in out.scheduled:
            if s.request_id == "b" and s.reset_block_table and computed_at_preemption is not None:
                assert s.num_computed_tokens == computed_at_preemption  # resumed, not recomputed
                assert ("host", "device") in {(c.src, c.dst) for c in out.kv_transfers.copies}
        sched.update(out, sample_all(out), now)
        now += 1.0
    assert computed_at_preemption is not None
    stats = sched.stats()
    assert stats.num_preemptions >= 1 and stats.offload.swapped_out_requests == stats.num_preemptions
    assert sched.kv_cache_manager.tiers.host.num_held == 0
    assert a.output_token_ids == b.output_token_ids == [7] * 12


def test_swap_falls_back_to_recompute_when_the_host_tier_is_full() -> None:
    # A host tier too small for any victim.
    sched = make_scheduler(num_blocks=6, block_size=BS, max_model_len=32, preemption_mode="swap", host_blocks=1)
    for rid in ("a", "b"):
        sched.add_request(make_request(rid, 8, max_tokens=12))
    run_to_completion(sched)
    stats = sched.stats()
    assert stats.num_preemptions >= 1
    assert stats.offload.swapped_out_requests == 0 and stats.offload.swap_out_refusals == stats.num_preemptions


def test_an_aborted_swapped_request_gives_its_slots_back() -> None:
    sched = make_scheduler(num_blocks=6, block_size=BS, max_model_len=32, preemption_mode="swap", host_blocks=16)
    a, b = make_request("a", 8, max_tokens=12), make_request("b", 8, max_tokens=12)
    sched.add_request(a)
    sched.add_request(b)
    now = 0.0
    while not sched.kv_cache_manager.is_swapped(b):
        out = sched.schedule(now)
        sched.update(out, sample_all(out), now)
        now += 1.0
    assert sched.kv_cache_manager.tiers.host.num_held > 0
    assert sched.abort_request("b", now)
    sched.kv_cache_manager.begin_step()
    assert sched.kv_cache_manager.tiers.host.num_held == 0


def test_external_kv_is_listed_after_the_prefix_hit() -> None:
    sched = make_scheduler(num_blocks=16, block_size=BS)
    runner = FakeRunner(sched)
    prefix = list(range(200, 208))
    _serve(sched, make_request("a", prefix + [1], max_tokens=1), runner)
    r = make_request("r", prefix + list(range(300, 310)), max_tokens=2)
    r.num_external_computed_tokens = r.num_prompt_tokens - 1  # a prefill instance sent all but the last
    runner.external["r"] = list(r.prompt_token_ids)
    sched.add_request(r)
    out = sched.schedule(5.0)
    [load] = out.kv_transfers.external
    # 8 tokens hit the device cache (2 blocks); the external 9 follow in blocks 2..4.
    assert load.first_block == 2 and len(load.block_ids) == 3
    assert load.block_ids == tuple(sched.kv_cache_manager.get_block_ids("r")[2:5])
    [s] = out.scheduled
    assert s.num_computed_tokens == 17 and len(s.token_ids) == 1
    runner.execute(out)


def test_tiers_need_a_host_tier_before_a_disk() -> None:
    with pytest.raises(ValueError, match="needs a host tier"):
        KVCacheManager(8, BS, disk_blocks=4)
    with pytest.raises(ValueError, match="host_blocks=-1"):
        KVCacheManager(8, BS, host_blocks=-1)
