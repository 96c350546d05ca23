"""Tensor parallelism as Megatron-LM lays it out: each rank keeps its part of every weight.

- q/k/v and gate/up are column-parallel: a rank keeps the rows of its heads (its KV heads; a KV
  head shared by several ranks when there are fewer KV heads than ranks, as vLLM replicates them)
  and of its share of the MLP width; no communication.
- o_proj and down_proj are row-parallel: a rank multiplies its columns and one all-reduce sums
  the partial outputs, so a layer costs two all-reduces of tokens x hidden.
- The embedding and the LM head are vocabulary-parallel: a rank keeps a contiguous range of rows;
  the embedding all-reduces (each token's row lives on one rank), the head all-gathers logits.
- Routed experts split each expert's width (then the MoE layer all-reduces like an MLP) or, with
  expert parallelism, place whole experts on ranks (engine/parallel/moe.py).

`shard_model` works on a loaded CausalLM in place, so every rank starts from the same weights as
one process would and keeps its slice: the greedy output equals one process's up to float
summation order (the all-reduces add partial sums in another order).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
import torch.nn.functional as F

from engine.config import ModelConfig
from engine.errors import InputError
from engine.model.decoder import CausalLM, DecoderLayer, SelfAttention
from engine.model.layers import Embedding, GatedMLP, Linear
from engine.model.moe import SparseMoE
from engine.parallel.group import TPGroup
from engine.parallel.moe import ExpertParallelMoE, shard_expert_width


def check_shardable(config: ModelConfig, tp: int, ep: int) -> None:
    """Refuse a split the model's shapes do not allow, before any process starts."""
    name = config.name or config.model_type
    if config.num_attention_heads % tp:
        raise InputError("tensor_parallel", tp, f"must divide the {config.num_attention_heads} attention heads of {name}")
    if config.num_kv_heads % tp and tp % config.num_kv_heads:
        raise InputError("tensor_parallel", tp, f"must divide, or be a multiple of, the {config.num_kv_heads} KV heads of {name}")
    if not all(config.layer_is_moe) and config.intermediate_size % tp:
        raise InputError("tensor_parallel", tp, f"must divide the MLP width {config.intermediate_size} of {name}")
    if ep > 1:
        if config.moe is None or not config.is_moe:
            raise InputError("expert_parallel", ep, f"{name} has no routed experts to place")
        if config.moe.num_experts % ep:
            raise InputError("expert_parallel", ep, f"must divide the {config.moe.num_experts} experts of {name}")
    elif config.moe is not None and config.moe.expert_intermediate_size % tp:
        raise InputError("tensor_parallel", tp,
                         f"must divide the expert width {config.moe.expert_intermediate_size} of {name} (or use expert_parallel)")


def local_config(config: ModelConfig, tp: int) -> ModelConfig:
    """The shapes one rank's attention and KV cache see: its query heads and KV heads."""
    from dataclasses import replace

    return replace(config, num_attention_heads=config.num_attention_heads // tp,
                   num_kv_heads=max(1, config.num_kv_heads // tp))


def shard_model(model: CausalLM, group: TPGroup, expert_parallel: bool) -> None:
    """Keep this rank's part of every weight of `model`, in place."""
    config = model.config
    check_shardable(config, group.size, group.size if expert_parallel else 1)
    inner = model.model
    embedding, lm_head = inner.embed_tokens, model.lm_head
    # As built: a rank loads the model unquantised (engine/parallel/worker.py) and shards it once.
    assert isinstance(embedding, Embedding) and isinstance(lm_head, Linear)
    sharded = VocabParallelEmbedding(embedding.weight, group)
    inner.embed_tokens = sharded
    for layer in inner.layers:
        assert isinstance(layer, DecoderLayer)
        _shard_attention(layer.self_attn, config, group)
        layer.mlp = _shard_mlp(layer.mlp, group, expert_parallel)
    head = sharded.weight if config.tie_word_embeddings else _rows(lm_head.weight, group)
    model.lm_head = ParallelLMHead(head, config.vocab_size, group)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local @ W_local^T) + b: this rank's input columns, partial sums added up."""

    def __init__(self, weight: Tensor, bias: Tensor | None, group: TPGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)  # added once, after the sum
        self.group = group

    def forward(self, x: Tensor) -> Tensor:
        y = self.group.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + rows) of the embedding; other ids look up zeros, and the all-reduce
    fills in the rank that has them."""

    def __init__(self, weight: Tensor, group: TPGroup) -> None:
        super().__init__()
        self.start, self.num_rows = _vocab_range(weight.shape[0], group)
        self.weight = nn.Parameter(_rows(weight, group), requires_grad=False)
        self.group = group

    def forward(self, ids: Tensor) -> Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_rows)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.group.all_reduce(x.masked_fill(outside[:, None], 0.0))


class ParallelLMHead(nn.Module):
    """Logits of this rank's vocabulary rows, all-gathered into every row's full logits. The last
    shard is padded to the others' size for the gather and the padding cut off after."""

    def __init__(self, weight: Tensor, vocab_size: int, group: TPGroup) -> None:
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.vocab_size, self.shard = vocab_size, -(-vocab_size // group.size)
        self.group = group

    def forward(self, hidden: Tensor) -> Tensor:
        local = F.linear(hidden, self.weight)
        if local.shape[1] < self.shard:
            local = F.pad(local, (0, self.shard - local.shape[1]))
        gathered = self.group.all_gather(local.T.contiguous())  # [size * shard, N]: rank-major rows
        return gathered[: self.vocab_size].T


def _shard_attention(attn: SelfAttention, config: ModelConfig, group: TPGroup) -> None:
    tp, rank, d = group.size, group.rank, attn.head_dim
    heads, kv_heads = config.num_attention_heads // tp, max(1, config.num_kv_heads // tp)
    # With fewer KV heads than ranks, consecutive ranks share one: their query heads all map to it.
    first_kv = rank * config.num_kv_heads // tp
    q_rows = torch.arange(rank * heads * d, (rank + 1) * heads * d)
    kv_rows = torch.arange(first_kv * d, (first_kv + kv_heads) * d)
    q_size, kv_size = attn.q_size, attn.kv_size
    rows = torch.cat([q_rows, q_size + kv_rows, q_size + kv_size + kv_rows])
    qkv = attn.qkv_proj
    attn.qkv_proj = _linear(qkv.weight[rows], None if qkv.bias is None else qkv.bias[rows])
    o = attn.o_proj
    assert isinstance(o, Linear)
    attn.o_proj = RowParallelLinear(o.weight[:, q_rows].contiguous(), None if o.bias is None else o.bias.detach().clone(), group)
    attn.num_heads, attn.num_kv_heads = heads, kv_heads
    attn.q_size, attn.kv_size = heads * d, kv_heads * d


def _shard_mlp(mlp: nn.Module, group: TPGroup, expert_parallel: bool) -> nn.Module:
    if isinstance(mlp, SparseMoE):
        return ExpertParallelMoE(mlp, group) if expert_parallel else shard_expert_width(mlp, group)
    assert isinstance(mlp, GatedMLP)
    width = mlp.down_proj.weight.shape[1]
    cols = _split(width, group)
    mlp.gate_up_proj = _linear(torch.cat([mlp.gate_up_proj.weight[cols], mlp.gate_up_proj.weight[width:][cols]]), None)
    mlp.down_proj = RowParallelLinear(mlp.down_proj.weight[:, cols].contiguous(), None, group)  # type: ignore[assignment]
    return mlp


def _linear(weight: Tensor, bias: Tensor | None) -> Linear:
    """A plain Linear holding copies of the given rows (the full tensor it came from can be freed)."""
    layer = Linear(weight.shape[1], weight.shape[0], bias is not None)
    with torch.no_grad():
        layer.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
    return layer


def _split(n: int, group: TPGroup) -> slice:
    """This rank's contiguous share of n (n divisible by the group's size)."""
    part = n // group.size
    return slice(group.rank * part, (group.rank + 1) * part)


def _vocab_range(vocab: int, group: TPGroup) -> tuple[int, int]:
    """(first row, rows) of this rank's vocabulary shard: ceil(V / size) rows each, the last fewer."""
    shard = -(-vocab // group.size)
    start = min(group.rank * shard, vocab)
    return start, min(shard, vocab - start)


def _rows(weight: Tensor, group: TPGroup) -> Tensor:
    start, rows = _vocab_range(weight.shape[0], group)
    return weight.detach()[start : start + rows].clone()
