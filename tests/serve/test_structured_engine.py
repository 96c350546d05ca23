"""Structured outputs in the engine: the grammar mask applies in greedy and sampled decoding, with
a byte-level toy vocabulary and with SmolLM2's real BPE vocabulary; what it cannot serve is refused."""

from __future__ import annotations

from collections.abc import Callable
import json
from pathlib import Path
import re

import jsonschema
import pytest

from engine.core import SamplingParams, StructuredOutput
from engine.errors import InputError
from engine.llm import LLM

REGEX = r"(cat|dog)-[0-9]{2,4}\.[a-f]{3}"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "pet": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    },
    "required": ["name", "age", "tags", "pet"],
}


@pytest.fixture(scope="module")
def llm(byte_model: Path) -> LLM:
    return LLM(str(byte_model), random_weights=True, seed=1, num_kv_blocks=256, block_size_tokens=16)


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.5])
def test_every_output_matches_its_regex_greedy_or_sampled(llm: LLM, temperature: float) -> None:
    constraint = StructuredOutput("regex", REGEX)
    params = [SamplingParams(max_tokens=64, temperature=temperature, seed=s, structured_output=constraint)
              for s in range(6)]
    outs = llm.generate([f"prompt {i}" for i in range(6)], params)
    for out in outs:
        assert out.finish_reason == "stop" and re.fullmatch(REGEX, out.text), out.text
    # The same engine without the mask writes something else: the mask is what made them match.
    free = llm.generate(["prompt 0"], SamplingParams(max_tokens=12, temperature=temperature, seed=0))
    assert not re.fullmatch(REGEX, free[0].text)


def test_json_schema_outputs_validate_beside_unconstrained_requests(llm: LLM) -> None:
    constraint = StructuredOutput("json_schema", json.dumps(SCHEMA))
    params = [SamplingParams(max_tokens=400, temperature=t, seed=3, structured_output=constraint) for t in (0.0, 1.0)]
    params.append(SamplingParams(max_tokens=20, ignore_eos=True))  # shares the batch, unmasked
    outs = llm.generate(["a", "b", "c"], params)
    for out in outs[:2]:
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert len(outs[2].token_ids) == 20


def test_grammar_and_refusals(llm: LLM, byte_model: Path, tiny_model: Callable[..., Path]) -> None:
    grammar = 'root ::= "yes" | "no" | "maybe " [0-9]'
    [out] = llm.generate(["?"], SamplingParams(max_tokens=16, temperature=1.0, seed=2,
                                               structured_output=StructuredOutput("grammar", grammar)))
    assert re.fullmatch(r"yes|no|maybe [0-9]", out.text)

    with pytest.raises(InputError, match="grammar=.* cannot be compiled: .*not defined"):
        llm.add_request("x", SamplingParams(structured_output=StructuredOutput("grammar", "root ::= nothing")))
    with pytest.raises(InputError, match="json_schema=.* cannot be compiled"):
        llm.add_request("x", SamplingParams(structured_output=StructuredOutput("json_schema", "{not json")))
    with pytest.raises(InputError, match="ignore_eos=True is invalid: cannot go with a structured_output"):
        SamplingParams(ignore_eos=True, structured_output=StructuredOutput("regex", "a"))

    speculative = LLM(str(byte_model), random_weights=True, num_kv_blocks=64, block_size_tokens=16,
                      speculative={"method": "self", "num_speculative_tokens": 2, "draft_layers": 1})
    with pytest.raises(InputError, match="not supported with speculative decoding"):
        speculative.add_request("x", SamplingParams(structured_output=StructuredOutput("regex", "a")))
    no_tokenizer = LLM(str(tiny_model()), random_weights=True, num_kv_blocks=16, block_size_tokens=4)
    with pytest.raises(InputError, match="needs the model's tokenizer"):
        no_tokenizer.add_request([1], SamplingParams(structured_output=StructuredOutput("regex", "a")))


def test_a_real_bpe_vocabulary(tiny_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> None:
    """SmolLM2's tokenizer (49,152 tokens, multi-byte BPE merges) on a tiny random model: xgrammar
    must read this vocabulary right for masks over tokens that span several characters."""
    folder = tiny_model("tiny-smollm2-vocab", vocab_size=49152, max_position_embeddings=1024)
    _smollm2_tokenizer().save_pretrained(folder)
    engine = LLM(str(folder), random_weights=True, seed=0, num_kv_blocks=128, block_size_tokens=16)
    constraint = StructuredOutput("json_schema", json.dumps(SCHEMA))
    outs = engine.generate(["Describe a person as JSON.", "{"], [
        SamplingParams(max_tokens=300, structured_output=constraint),
        SamplingParams(max_tokens=300, temperature=1.0, seed=1, structured_output=constraint)])
    for out in outs:
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert any(len(engine.tokenizer.decode([t])) > 1 for out in outs for t in out.token_ids)  # multi-character tokens


def _smollm2_tokenizer():  # noqa: ANN202 (transformers tokenizer)
    import gguf

    from engine.model import gguf_checkpoint

    path = gguf_checkpoint.packaged_gguf_path("smollm2-135m")
    return gguf_checkpoint.gguf_tokenizer(gguf.GGUFReader(str(path)), path)
