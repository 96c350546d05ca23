"""Tiny transformers models as references, and a driver that runs ours the way the engine does.

The driver feeds sequences through our model in steps (flat batches that mix prefill chunks
and decodes) over a paged cache whose blocks come from a shuffled pool, so a sequence's
blocks are never contiguous and never in order.
"""

from __future__ import annotations

import random

import torch
from torch import Tensor
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    PreTrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from engine.kernels.metadata import build_attention_metadata
from engine.model.decoder import CausalLM

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small, so that the tiny head_dim has wavelengths in all three llama3 bands.
    "original_max_position_embeddings": 16,
}


def tiny_hf_config(arch: str) -> PreTrainedConfig:
    """One tiny config per family, each switching on what sets the family apart."""
    if arch == "llama":
        return LlamaConfig(**TINY, rope_parameters=LLAMA3_ROPE)
    if arch == "qwen2":  # q/k/v biases, tied embeddings
        return Qwen2Config(**TINY, tie_word_embeddings=True)
    if arch == "qwen3":  # q/k norm, head_dim decoupled from hidden/heads, biases on q/k/v/o
        return Qwen3Config(**TINY, head_dim=32, attention_bias=True)
    if arch == "mistral":  # a window shorter than the prompts
        return MistralConfig(**TINY, sliding_window=6)
    if arch == "mixtral":
        return MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2)
    if arch == "qwen3_moe":  # normalised top-k, and a dense layer among the MoE ones
        return Qwen3MoeConfig(
            **TINY, head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
            norm_topk_prob=True, mlp_only_layers=[1],
        )
    raise ValueError(arch)


def tiny_hf_model(arch: str, seed: int = 0) -> PreTrainedModel:
    """A random fp32 model with eager attention and weights large enough for attention to be
    far from uniform and norm weights far from 1, so that any mix-up shows in the logits."""
    torch.manual_seed(seed)
    config = tiny_hf_config(arch)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1 + 0.2 * noise if name.endswith("norm.weight") else 0.15 * noise)
    return model


def hf_logits(model: PreTrainedModel, tokens: list[int]) -> Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


class PagedDriver:
    """Runs our model step by step: each step is {sequence: the tokens it adds}."""

    def __init__(self, model: CausalLM, *, block_size: int = 4, num_blocks: int = 64, seed: int = 0) -> None:
        self.model, self.block_size = model, block_size
        self.kv_caches = model.allocate_kv_caches(num_blocks, block_size)
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.block_tables: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}

    def step(self, work: dict[str, list[int]]) -> dict[str, Tensor]:
        """Logits [new tokens, V] per sequence."""
        query_lens, seq_lens, tables, input_ids = [], [], [], []
        for seq, tokens in work.items():
            table = self.block_tables.setdefault(seq, [])
            seq_len = self.num_computed.get(seq, 0) + len(tokens)
            while len(table) * self.block_size < seq_len:
                table.append(self.free_blocks.pop())
            self.num_computed[seq] = seq_len
            query_lens.append(len(tokens))
            seq_lens.append(seq_len)
            tables.append(table)
            input_ids += tokens
        positions, metadata = build_attention_metadata(query_lens, seq_lens, tables, self.block_size)
        with torch.inference_mode():
            hidden = self.model(torch.tensor(input_ids), positions, metadata, self.kv_caches)
            logits = self.model.compute_logits(hidden)
        return dict(zip(work, logits.split(query_lens)))


def to_hf_state_dict(model: CausalLM) -> dict[str, Tensor]:
    """Our dense model's weights under HF names: fused q/k/v and gate/up split back apart."""
    c = model.config
    q_size, kv_size = c.num_attention_heads * c.head_dim, c.num_kv_heads * c.head_dim
    state: dict[str, Tensor] = {}
    for name, tensor in model.state_dict().items():
        prefix, _, leaf = name.rpartition(".")
        if prefix.endswith("qkv_proj"):
            base = prefix.removesuffix("qkv_proj")
            for part, t in zip(("q_proj", "k_proj", "v_proj"), tensor.split([q_size, kv_size, kv_size])):
                state[f"{base}{part}.{leaf}"] = t
        elif prefix.endswith("gate_up_proj"):
            base = prefix.removesuffix("gate_up_proj")
            gate, up = tensor.chunk(2)
            state[f"{base}gate_proj.{leaf}"], state[f"{base}up_proj.{leaf}"] = gate, up
        else:
            state[name] = tensor
    return state
