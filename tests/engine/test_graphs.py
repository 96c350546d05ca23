"""Decode graphs: padding to captured sizes and static buffers give the eager engine's tokens.

The CUDA capture needs a GPU; here each "graph" replays its recorded forward with a plain
call over the same static buffers, which is everything but the capture itself.
"""

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.config import graph_capture_sizes
from engine.core import SamplingParams
from engine.graphs import DecodeGraphs
from engine.errors import InputError
from engine.llm import LLM
from engine.kernels.metadata import build_attention_metadata
from tests.engine.test_llm import make_llm, prompts, tokens


class CountingRecorder:
    """Replays each recorded forward with a plain call, counting replays per captured size."""

    def __init__(self, max_batch: int) -> None:
        self._order = iter(reversed(graph_capture_sizes(max_batch)))  # DecodeGraphs records largest first
        self.replays: dict[int, int] = {}

    def __call__(self, run: Callable[[], None]) -> Callable[[], None]:
        size = next(self._order)
        self.replays[size] = 0

        def replay() -> None:
            self.replays[size] += 1
            run()

        return replay

    @property
    def used(self) -> set[int]:
        return {size for size, n in self.replays.items() if n}


def graphed(model_dir: Path, max_batch: int = 16, **knobs) -> tuple[LLM, CountingRecorder]:
    llm = make_llm(model_dir, **knobs)
    recorder = CountingRecorder(max_batch)
    llm.runner.capture_decode_graphs(max_batch, llm.max_model_len, recorder)
    return llm, recorder


def test_only_cuda_engines_capture(model_dir) -> None:
    assert make_llm(model_dir).runner.graphs is None  # CPU: always eager


def test_graph_decodes_give_the_eager_tokens_as_the_batch_shrinks(model_dir) -> None:
    ps = prompts(n=7, seed=5)
    # Different lengths: the decode batch shrinks 7 -> 1 through padded sizes 8, 4, 2, 1.
    params = [SamplingParams(max_tokens=4 + 3 * i, ignore_eos=True) for i in range(len(ps))]
    eager = make_llm(model_dir)
    expected = tokens(eager.generate(ps, params))
    llm, recorder = graphed(model_dir)
    assert tokens(llm.generate(ps, params)) == expected
    assert recorder.used == {8, 4, 2, 1}
    # Padding rows wrote nothing: both caches hold the same keys and values.
    for ours, theirs in zip(llm.runner.kv_caches, eager.runner.kv_caches, strict=True):
        torch.testing.assert_close(ours, theirs)


def test_mixed_and_oversized_steps_run_eagerly(model_dir) -> None:
    ps = prompts(n=6, seed=6)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    expected = tokens(make_llm(model_dir).generate(ps, params))
    # max batch 4 < 6 requests; a prefill chunk budget of 16 tokens mixes prefills into decode steps.
    llm, recorder = graphed(model_dir, max_batch=4, max_num_batched_tokens=16)
    assert tokens(llm.generate(ps, params)) == expected
    assert 0 < sum(recorder.replays.values()) < llm.scheduler.stats().num_steps


def test_preemption_under_graphs_recomputes_to_the_same_tokens(model_dir) -> None:
    ps = prompts(n=8, seed=3)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    expected = tokens(make_llm(model_dir).generate(ps, params))
    llm, _ = graphed(model_dir, num_kv_blocks=40)
    assert tokens(llm.generate(ps, params)) == expected
    assert llm.scheduler.stats().num_preemptions > 0


def test_padding_rows_are_inert(model_dir) -> None:
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(ids, positions, metadata):
        seen.append((metadata.slot_mapping.clone(), metadata.seq_lens.clone()))
        return torch.zeros(ids.shape[0], 8)

    graphs = DecodeGraphs(forward, 8, torch.float32, 8, 64, 4, torch.device("cpu"), lambda run: run)
    positions, metadata = build_attention_metadata([1, 1, 1], [5, 9, 2], [[3, 4], [5, 6, 7], [8]], 4)
    out = graphs.run(torch.tensor([1, 2, 3]), positions, metadata)
    assert out.shape == (3, 8)
    slots, seq_lens = seen[-1]
    assert slots.tolist() == [*metadata.slot_mapping.tolist(), -1]  # padded to 4: one row writes nothing
    assert seq_lens.tolist() == [5, 9, 2, 1]


@pytest.mark.parametrize("bad", [{"max_graph_batch_size": 0}, {"enforce_eager": "sometimes"}])
def test_bad_graph_knobs_are_refused(model_dir, bad) -> None:
    with pytest.raises(InputError, match=next(iter(bad))):
        make_llm(model_dir, **bad)


def test_compiled_decode_gives_the_eager_tokens(model_dir) -> None:
    """compile_model: torch.compile of each captured size's forward (here on the CPU, without CUDA graphs)."""
    ps = prompts(n=3, seed=8)
    params = [SamplingParams(max_tokens=3 + 3 * i, ignore_eos=True) for i in range(len(ps))]
    expected = tokens(make_llm(model_dir).generate(ps, params))
    llm = make_llm(model_dir, compile_model=True, max_graph_batch_size=2)
    assert llm.runner.graphs is not None and llm.runner.graphs.sizes == (1, 2)
    assert tokens(llm.generate(ps, params)) == expected
