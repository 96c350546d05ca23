"""Our decoder over the paged cache against transformers, for every supported family.

Every test saves a tiny random HF model with save_pretrained, loads it with our loader and
compares our logits, position by position, with transformers' logits for the whole sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import Tensor
from transformers import PreTrainedModel

from engine.model.loader import load_model
from engine.model.decoder import CausalLM

from .reference import PagedDriver, hf_logits, tiny_hf_model

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen3_moe")
ATOL = 1e-4


@dataclass
class Pair:
    hf: PreTrainedModel
    ours: CausalLM

    def sequences(self, *lengths: int, seed: int = 1) -> list[list[int]]:
        generator = torch.Generator().manual_seed(seed)
        vocab = self.ours.config.vocab_size
        return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]


@pytest.fixture(scope="module", params=ARCHS)
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Pair:
    hf = tiny_hf_model(request.param)
    folder: Path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    return Pair(hf, load_model(str(folder)).model)


def assert_close(ours: Tensor, reference: Tensor) -> None:
    assert ours.shape == reference.shape
    diff = (ours - reference).abs().max().item()
    assert diff < ATOL, f"max abs diff {diff:.2e}"


def test_prefill_of_several_prompts_in_one_flat_batch(pair: Pair) -> None:
    prompts = pair.sequences(5, 9, 3)
    logits = PagedDriver(pair.ours).step({f"s{i}": p for i, p in enumerate(prompts)})
    for i, prompt in enumerate(prompts):
        assert_close(logits[f"s{i}"], hf_logits(pair.hf, prompt))


def test_decode_steps_over_the_paged_cache(pair: Pair) -> None:
    # Prompts of 5, 9 and 3 tokens, then 6 decode steps: every sequence crosses block
    # boundaries, and Mistral's window of 6 starts hiding the oldest keys.
    full = pair.sequences(11, 15, 9, seed=2)
    driver = PagedDriver(pair.ours, seed=3)
    driver.step({"a": full[0][:5], "b": full[1][:9], "c": full[2][:3]})
    references = [hf_logits(pair.hf, seq) for seq in full]
    for step in range(6):
        work = {"a": [full[0][5 + step]], "b": [full[1][9 + step]], "c": [full[2][3 + step]]}
        logits = driver.step(work)
        for seq, start, reference in zip("abc", (5, 9, 3), references):
            assert_close(logits[seq], reference[start + step : start + step + 1])


def test_chunked_prefill_over_a_cached_prefix(pair: Pair) -> None:
    (prompt,) = pair.sequences(14, seed=4)
    reference = hf_logits(pair.hf, prompt)
    driver = PagedDriver(pair.ours, seed=5)
    start = 0
    for chunk in (5, 4, 5):
        logits = driver.step({"s": prompt[start : start + chunk]})
        assert_close(logits["s"], reference[start : start + chunk])
        start += chunk


def test_batch_mixing_decodes_and_prefill_chunks(pair: Pair) -> None:
    decoding, prefilling, other = pair.sequences(9, 12, 7, seed=6)
    ref_decoding, ref_prefilling, ref_other = (hf_logits(pair.hf, s) for s in (decoding, prefilling, other))
    driver = PagedDriver(pair.ours, seed=7)
    driver.step({"d": decoding[:7], "o": other[:6]})
    # One decode and one prefill chunk, then two decodes around the last chunk.
    logits = driver.step({"d": decoding[7:8], "p": prefilling[:6]})
    assert_close(logits["d"], ref_decoding[7:8])
    assert_close(logits["p"], ref_prefilling[:6])
    logits = driver.step({"o": other[6:7], "p": prefilling[6:12], "d": decoding[8:9]})
    assert_close(logits["o"], ref_other[6:7])
    assert_close(logits["p"], ref_prefilling[6:12])
    assert_close(logits["d"], ref_decoding[8:9])
