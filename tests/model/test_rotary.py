"""RoPE frequencies against transformers' own, for the scalings we support."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.catalog import resolve_model
from engine.errors import InputError
from engine.model.rotary import RotaryEmbedding, apply_rotary, rope_inverse_frequencies


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "linear", "factor": 4.0},
        resolve_model("llama-3.1-8b").rope_scaling,  # llama3: x8 from 8192
        resolve_model("llama-3.2-1b").rope_scaling,  # llama3: x32
    ],
)
def test_scaled_frequencies_match_transformers(scaling: dict) -> None:
    config = LlamaConfig(hidden_size=1024, num_attention_heads=8, rope_parameters={**scaling, "rope_theta": 500000.0})
    expected, attention_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu")
    assert attention_factor == 1.0
    assert torch.allclose(rope_inverse_frequencies(128, 500000.0, scaling), expected, rtol=1e-6)


def test_rotation_preserves_norms_and_relative_positions() -> None:
    rope = RotaryEmbedding(16, 10000.0, None)
    q, k = torch.randn(1, 2, 16), torch.randn(1, 2, 16)

    def score(q_pos: int, k_pos: int) -> torch.Tensor:
        cq, sq = rope(torch.tensor([q_pos]))
        ck, sk = rope(torch.tensor([k_pos]))
        return (apply_rotary(q, cq, sq) * apply_rotary(k, ck, sk)).sum(-1)

    cos, sin = rope(torch.tensor([5]))
    assert torch.allclose(apply_rotary(q, cos, sin).norm(dim=-1), q.norm(dim=-1), atol=1e-5)
    assert torch.allclose(score(7, 3), score(104, 100), atol=1e-4)


def test_unknown_rope_type_is_an_input_error() -> None:
    with pytest.raises(InputError, match="rope_type='yarn'"):
        rope_inverse_frequencies(64, 10000.0, {"rope_type": "yarn", "factor": 4.0})
