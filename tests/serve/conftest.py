"""Fixtures of the serve tests: the tiny byte-tokenizer model, and a check for error logs."""

from __future__ import annotations

from collections.abc import Callable, Iterator
import json
import logging
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from .helpers import CHAT_TEMPLATE, EOS, byte_level_vocab


@pytest.fixture(scope="session")
def byte_model(tiny_model: Callable[..., Path]) -> Path:
    folder = tiny_model("tiny-byte-llama", vocab_size=260, max_position_embeddings=1024)
    tokenizer = Tokenizer(models.BPE(vocab=byte_level_vocab(), merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([EOS])  # id 256; the model's vocabulary pads on to 260
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": EOS, "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE}))
    return folder


@pytest.fixture
def no_error_logs(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Fails a test that logged an error (an unhandled exception in the server, a traceback)."""
    caplog.set_level(logging.WARNING)
    yield
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]
