"""Structured outputs: a request's JSON schema, regex or grammar, applied as a token mask.

xgrammar compiles a constraint against the tokenizer's vocabulary once (cached by its text), and
a matcher per request walks it: before each sampled token it fills a bitmask of the tokens that
keep the output valid, after it the sampled token is accepted. Masked logits become -inf, so
greedy and sampled decoding alike can only pick allowed tokens, and once the output is complete
only end-of-sequence is allowed.

Why xgrammar (of xgrammar, llguidance and outlines-core, all three install and run on this CPU):
it is the default backend of vLLM, SGLang and TensorRT-LLM, so the mask cost measured here is
the one those servers pay; it takes JSON schemas, regexes and EBNF grammars; and it was the
fastest of the two we timed here (docs/serving.md; bench/structured_mask.py measures it).
outlines-core turns a schema into a regex, so it cannot express recursive schemas.

JSON is generated compact (no free whitespace between tokens): a model cannot then pad its
output with whitespace forever, and every schema with bounded strings and arrays has a bounded
output.

A length-bounded string (minLength/maxLength) is rewritten as the equivalent `pattern` before
xgrammar sees it: xgrammar 0.2.9 compiles such a string to a character class that admits raw
control characters, which makes invalid JSON (xgrammar issue 800, open when this was written;
our property test found it). Its pattern path writes valid JSON strings; in both, a bounded
string holds no escapes (no quotes, backslashes or newlines). xgrammar ignores a length beside a
pattern or format, so that combination is refused rather than silently loosened.
"""

from __future__ import annotations

from collections.abc import Sequence
import json
import re

import torch
from transformers import PreTrainedTokenizerBase
import xgrammar as xgr

from engine.core import SamplingParams, StructuredOutput
from engine.errors import InputError

# One compiler thread: the engine shares a 2-core machine with its front end.
COMPILER_THREADS = 1
ERROR_CHARS = 300  # the library's message about a bad constraint, cut to this length
_SOURCE_LOCATION = re.compile(r"\[[\d:]+\] \S+:\d+: ")  # xgrammar's "[16:13:26] /project/cpp/x.cc:94: "


class GrammarCompiler:
    """Compiles StructuredOutputs for one tokenizer; thread-safe (the server validates a
    request's constraint on its front end, the engine compiles it again from the cache)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_id: int | None) -> None:
        stop = [eos_token_id] if eos_token_id is not None else None
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop)
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(info, max_threads=COMPILER_THREADS)

    def compile(self, constraint: StructuredOutput) -> xgr.CompiledGrammar:
        """The compiled constraint; an InputError naming the kind when the library refuses it."""
        try:
            if constraint.kind == "json_schema":
                schema = json.loads(constraint.spec)  # the library's message for bad JSON names no position
                return self._compiler.compile_json_schema(json.dumps(_bounded_strings_as_patterns(schema)),
                                                          any_whitespace=False)
            if constraint.kind == "regex":
                return self._compiler.compile_regex(constraint.spec)
            return self._compiler.compile_grammar(constraint.spec)
        except (RuntimeError, ValueError) as exc:  # xgrammar raises these for bad input
            message = _SOURCE_LOCATION.sub("", " ".join(str(exc).split()))[:ERROR_CHARS]
            raise InputError(constraint.kind, _excerpt(constraint.spec), f"cannot be compiled: {message}") from None

    def matcher(self, constraint: StructuredOutput) -> xgr.GrammarMatcher:
        return xgr.GrammarMatcher(self.compile(constraint))


# Keywords whose values are data, not subschemas: never rewritten.
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})


def _bounded_strings_as_patterns(schema: object) -> object:
    """The schema with every string's minLength/maxLength expressed as a pattern (module docstring)."""
    if isinstance(schema, list):
        return [_bounded_strings_as_patterns(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: value if key in _DATA_KEYWORDS else _bounded_strings_as_patterns(value) for key, value in schema.items()}
    types = out.get("type")
    is_string = types == "string" or (isinstance(types, list) and "string" in types)
    if is_string and ("minLength" in out or "maxLength" in out):
        if "pattern" in out or "format" in out:
            raise InputError("json_schema", _excerpt(json.dumps(schema)),
                             "a string with minLength/maxLength and a pattern or format is not supported "
                             "(the grammar library would drop the length)")
        low, high = out.pop("minLength", 0), out.pop("maxLength", "")
        if not isinstance(low, int) or not isinstance(high, (int, str)):
            raise InputError("json_schema", _excerpt(json.dumps(schema)), "minLength and maxLength must be integers")
        out["pattern"] = f"^.{{{low},{high}}}$"
    return out


def _excerpt(text: str, chars: int = 80) -> str:
    return text if len(text) <= chars else text[: chars - 3] + "..."


class GrammarMasks:
    """The sampler's side: one matcher per constrained request, advanced token by token."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._matchers: dict[str, xgr.GrammarMatcher] = {}

    def forget(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def apply(self, logits: torch.Tensor, request_ids: Sequence[str], params: Sequence[SamplingParams]) -> list[int]:
        """Mask, in place, the rows of constrained requests; returns those rows."""
        rows = [i for i, p in enumerate(params) if p.structured_output is not None]
        if not rows:
            return rows
        bitmask = xgr.allocate_token_bitmask(logits.shape[0], self.compiler.vocab_size)
        for row in rows:
            self._matcher(request_ids[row], params[row]).fill_next_token_bitmask(bitmask, row)
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                        vocab_size=self.compiler.vocab_size, indices=rows)
        return rows

    def accept(self, request_id: str, token: int) -> None:
        if not self._matchers[request_id].accept_token(token):
            raise RuntimeError(f"request {request_id!r}: sampled token {token} outside its grammar mask: "
                               "the mask and the sampler disagree")

    def _matcher(self, request_id: str, p: SamplingParams) -> xgr.GrammarMatcher:
        matcher = self._matchers.get(request_id)
        if matcher is None:
            assert p.structured_output is not None
            matcher = self._matchers[request_id] = self.compiler.matcher(p.structured_output)
        return matcher
