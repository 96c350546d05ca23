"""Structured outputs through the API: for many random JSON schemas and prompts, greedy and
sampled, the official client gets JSON that validates against its schema, every time.

Schemas are bounded (strings, integers, arrays and objects all have limits) so that every valid
output fits max_tokens: a random-weight model must then reach the end of the grammar, and
finish_reason 'stop' is asserted, not assumed.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
import json
from pathlib import Path
import re

from hypothesis import HealthCheck, assume, given, settings, strategies as st
import jsonschema
import openai
import pytest

from .helpers import RunningServer, byte_llm, running_server

MAX_TOKENS = 700
BATCH = 6  # requests sent at once per example: they share the engine's batches, as in service

names = st.text(alphabet="abcdefgh_", min_size=1, max_size=5)
scalars = st.one_of(st.text(max_size=4), st.integers(-99, 99), st.booleans(), st.none())
leaves = st.one_of(
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(lambda low, span: {"type": "integer", "minimum": low, "maximum": low + span},
              st.integers(-1000, 1000), st.integers(0, 1000)),
    st.builds(lambda low, span: {"type": "string", "minLength": low, "maxLength": low + span},
              st.integers(0, 3), st.integers(0, 4)),
    st.lists(scalars, min_size=1, max_size=4, unique_by=json.dumps).map(lambda values: {"enum": values}),
)


def containers(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    objects = st.dictionaries(names, children, min_size=1, max_size=3).flatmap(lambda props: st.sets(
        st.sampled_from(sorted(props))).map(lambda required: {
            "type": "object", "properties": props, "required": sorted(required), "additionalProperties": False}))
    arrays = st.builds(lambda items, low, span: {"type": "array", "items": items, "minItems": low,
                                                 "maxItems": low + span}, children, st.integers(0, 2), st.integers(0, 2))
    return objects | arrays


schemas = st.recursive(leaves, containers, max_leaves=6)


def max_bytes(schema: dict) -> int:
    """The longest compact JSON (', ' and ': ' separators) that `schema` admits, in bytes = tokens."""
    if "enum" in schema:
        return max(max(len(json.dumps(v).encode()), len(json.dumps(v, ensure_ascii=False).encode()))
                   for v in schema["enum"])
    kind = schema["type"]
    if kind == "boolean":
        return 5
    if kind == "null":
        return 4
    if kind == "integer":
        return max(len(str(schema["minimum"])), len(str(schema["maximum"])))
    if kind == "string":
        return 2 + 4 * schema["maxLength"]  # unescaped UTF-8, up to 4 bytes a character
    if kind == "array":
        return 2 + schema["maxItems"] * (max_bytes(schema["items"]) + 2)
    return 2 + sum(len(json.dumps(k)) + 2 + max_bytes(v) + 2 for k, v in schema["properties"].items())


@pytest.fixture(scope="module")
def server(byte_model: Path) -> Iterator[RunningServer]:
    with running_server(byte_llm(byte_model, max_num_seqs=BATCH)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cases=st.lists(st.tuples(schemas, st.text(min_size=1, max_size=40), st.sampled_from([0.0, 0.8, 1.5])),
                      min_size=BATCH, max_size=BATCH))
def test_random_schemas_always_give_schema_valid_json(client: openai.OpenAI,
                                                      cases: list[tuple[dict, str, float]]) -> None:
    for schema, _, _ in cases:
        assume(max_bytes(schema) <= MAX_TOKENS - 1)  # room for every valid output and its end token

    def ask(case: tuple[dict, str, float]) -> tuple[dict, openai.types.chat.ChatCompletion]:
        schema, prompt, temperature = case
        return schema, client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS,
            temperature=temperature, seed=7,
            response_format={"type": "json_schema", "json_schema": {"name": "out", "schema": schema}})

    with ThreadPoolExecutor(BATCH) as pool:
        for schema, reply in pool.map(ask, cases):
            [choice] = reply.choices
            assert choice.finish_reason == "stop", (schema, choice.message.content)
            jsonschema.validate(json.loads(choice.message.content), schema)  # strict json: no raw control chars


def test_json_object_regex_grammar_and_choice(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "{}"}], max_tokens=300,
                                           temperature=0.0, response_format={"type": "json_object"})
    # Any object: a random model may write a long one; a complete one parses.
    content = reply.choices[0].message.content
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    else:
        assert content.startswith("{")

    cases = {"regex": (r"[A-Z]{2}-\d{3}", lambda text: re.fullmatch(r"[A-Z]{2}-\d{3}", text)),
             "grammar": ('root ::= "(" [a-c]+ ")" | "none"', lambda text: re.fullmatch(r"\([a-c]+\)|none", text)),
             "choice": (["red", "green", 'say "hi"'], lambda text: text in ("red", "green", 'say "hi"'))}
    for kind, (spec, check) in cases.items():
        for temperature in (0.0, 1.0):
            out = client.completions.create(model="tiny", prompt="x", max_tokens=64, temperature=temperature, seed=1,
                                            extra_body={"structured_outputs": {kind: spec}})
            assert out.choices[0].finish_reason == "stop" and check(out.choices[0].text), (kind, out.choices[0].text)


def test_the_client_parse_helper_gets_a_typed_object(client: openai.OpenAI) -> None:
    from pydantic import BaseModel, Field

    class Reading(BaseModel):
        sensor: str = Field(max_length=4)
        value: int = Field(ge=0, le=99)
        ok: bool

    reply = client.chat.completions.parse(model="tiny", messages=[{"role": "user", "content": "reading?"}],
                                          response_format=Reading, max_tokens=200, temperature=0.0)
    reading = reply.choices[0].message.parsed
    assert isinstance(reading, Reading) and 0 <= reading.value <= 99


def test_a_length_bounded_string_never_holds_a_raw_control_character(client: openai.OpenAI) -> None:
    """xgrammar alone lets them into strings with maxLength (see engine/structured_output.py)."""
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 8}}, "required": ["s"]}
    for seed in range(12):
        reply = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "go"}], max_tokens=80, temperature=1.5, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
        value = json.loads(reply.choices[0].message.content)["s"]
        assert not any(ord(c) < 0x20 for c in value) and len(value) <= 8


def test_a_length_beside_a_pattern_is_refused(client: openai.OpenAI) -> None:
    schema = {"type": "string", "pattern": "[a-z]+", "maxLength": 3}
    with pytest.raises(openai.BadRequestError, match="minLength/maxLength and a pattern or format is not supported"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=8,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "s", "schema": schema}})
