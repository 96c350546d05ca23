"""Published runs with data-parallel attention replay as the engine ran them."""

from __future__ import annotations

import math

from planner.public.data import PublicRun, public_runs
from planner.public.fit import Figures
from planner.public.replay import ReplayRun, predicted, prepare

SOURCE = "gpustack-deepseek-r1-h200"


def _dp_attention_runs() -> list[PublicRun]:
    return [r for r in public_runs() if r.source_key == SOURCE and r.engine.args.get("enable_dp_attention")]


def test_sglang_dp_attention_at_dp_size_1_replays_as_tensor_parallel_attention() -> None:
    """GPUStack served DeepSeek-R1 with `--tp 8 --enable-dp-attention` and no `--dp`: SGLang turns
    the flag off at dp size 1, so the runs replay (saying so) instead of being set aside."""
    runs = _dp_attention_runs()
    prepared = {r.run_key: prepare(r) for r in runs}
    replayed = [p for p in prepared.values() if isinstance(p, ReplayRun)]
    set_aside = {k: p for k, p in prepared.items() if isinstance(p, str)}
    assert len(replayed) == 6
    assert list(set_aside.values()) == ["EAGLE speculative decoding: the draft head's acceptance is not published"]
    for run in replayed:
        assert run.dep.tensor_parallel == 8 and run.dep.attention_data_parallel == 1
        assert any("turns DP attention off at dp size 1" in a for a in run.assumptions)
    smallest = min(replayed, key=lambda r: r.run.client.num_prompts * (r.run.lengths.input_tokens or 10**9))
    values = predicted(smallest, smallest.simulate(Figures().params(smallest)).summary)
    assert values.keys() == {f.id for f in smallest.figures}
    assert all(math.isfinite(v) and v > 0 for v in values.values())


def test_dp_attention_with_a_dp_size_runs_attention_groups_inside_one_engine() -> None:
    run = next(r for r in _dp_attention_runs() if "speculative_algorithm" not in r.engine.args)
    grouped = run.model_copy(update={"deployment": run.deployment.model_copy(update={"data_parallel": 4})})
    replay = prepare(grouped)
    assert isinstance(replay, ReplayRun)
    assert replay.dep.attention_data_parallel == 4 and replay.dep.tensor_parallel == 8
    assert not any("dp size 1" in a for a in replay.assumptions)
    odd = run.model_copy(update={"deployment": run.deployment.model_copy(update={"data_parallel": 3})})
    assert prepare(odd) == "DP attention over 3 groups does not divide tensor parallel 8"
    # Without the flag, data parallelism is engines behind a router, which the data cannot describe.
    plain = grouped.model_copy(update={"engine": run.engine.model_copy(update={"args": {}})})
    assert prepare(plain) == "data-parallel engines behind one client are not replayed"
