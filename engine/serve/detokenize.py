"""Text deltas for a stream: the concatenation of what a stream sends is the whole output's text.

A token may be part of a character (byte-level vocabularies split UTF-8), so a delta is sent only
once the text decoded so far no longer ends in U+FFFD, and the rest goes out with the last
tokens. Decoding only the tokens since the last delta (plus the few before, for context) keeps a
step's cost independent of the output's length: vLLM's prefix/read offsets.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from transformers import PreTrainedTokenizerBase

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # start of the decoded window: tokens before it are out for good
        self._read = 0  # tokens whose text has been sent

    def add(self, token_ids: Sequence[int], final: bool) -> str:
        """The text that `token_ids` complete (all that is left when `final`)."""
        self._ids.extend(token_ids)
        if self._tokenizer is None:
            return ""
        decode = self._tokenizer.decode
        # One list of ids decodes to one str (transformers' return type covers a batch of lists too).
        sent = cast(str, decode(self._ids[self._prefix : self._read], skip_special_tokens=True))
        text = cast(str, decode(self._ids[self._prefix :], skip_special_tokens=True))
        if len(text) <= len(sent) or (text.endswith(REPLACEMENT) and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(sent) :]
