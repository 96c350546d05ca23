"""A Llama-family decoder built from ModelConfig: Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE.

Pre-norm residual blocks of GQA attention over a paged KV cache and a SwiGLU MLP (dense or
routed). Module names follow HF checkpoints (model.layers.N.self_attn..., lm_head), except
that q/k/v and gate/up are stored fused (qkv_proj, gate_up_proj): one matmul instead of
three or two. The loader packs the checkpoint's separate tensors into them.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from engine.config import ModelConfig
from engine.dtypes import QuantWeightDtype
from engine.errors import InputError
from engine.kernels.metadata import AttentionMetadata
from engine.model.attention import allocate_kv_caches, attend, native_decode_applies
from engine.model.layers import Embedding, GatedMLP, Linear, RMSNorm, weight_of
from engine.model.moe import SparseMoE
from engine.model.rotary import RotaryEmbedding, rotate_qk
from engine.quant import native

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe")


def check_supported(config: ModelConfig) -> None:
    """Raise InputError for architecture features this decoder does not implement."""
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise InputError("model_type", config.model_type, f"the engine runs: {', '.join(SUPPORTED_MODEL_TYPES)}")
    act = config.hf_config.get("hidden_act", "silu")
    if act != "silu":
        raise InputError("hidden_act", act, "the engine runs SwiGLU (silu) MLPs only")
    if config.hf_config.get("mlp_bias"):
        raise InputError("mlp_bias", True, "MLP biases are not supported")


def o_proj_has_bias(config: ModelConfig) -> bool:
    # Qwen2 puts biases on q/k/v only; Llama and Qwen3 put attention_bias on all four.
    return config.attention_bias and config.model_type != "qwen2"


def renormalizes_top_k(config: ModelConfig) -> bool:
    if config.model_type == "mixtral":
        return True
    return bool(config.hf_config.get("norm_topk_prob", False))


class SelfAttention(nn.Module):
    def __init__(self, config: ModelConfig, window: int | None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.window = window
        self.scale = self.head_dim**-0.5
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        # Replaced by quantize_model (a quantised Linear) or shard_model (a RowParallelLinear).
        self.o_proj: nn.Module = Linear(self.q_size, config.hidden_size, bias=o_proj_has_bias(config))
        # Qwen3 normalises each head's q and k before RoPE, which keeps attention logits bounded.
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, metadata: AttentionMetadata, kv_cache: Tensor
    ) -> Tensor:
        tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.q_norm is None and native_decode_applies(qkv, kv_cache, metadata):
            out = native.decode_attention(qkv, cos, sin, kv_cache, metadata, self.num_heads, self.num_kv_heads,
                                          self.scale, self.window)
            return self.o_proj(out)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotate_qk(q, k, cos, sin)
        out = attend(q, k, v, kv_cache, metadata, self.scale, self.window)
        return self.o_proj(out.reshape(tokens, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = SelfAttention(config, config.layer_windows[layer])
        self.mlp: nn.Module
        if config.layer_is_moe[layer]:
            assert config.moe is not None
            self.mlp = SparseMoE(
                config.hidden_size,
                config.moe.expert_intermediate_size,
                config.moe.num_experts,
                config.moe.top_k,
                renormalizes_top_k(config),
            )
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self._native: native.DecodeLayer | None = None

    def forward(
        self, x: Tensor, residual: Tensor | None, cos: Tensor, sin: Tensor, metadata: AttentionMetadata, kv_cache: Tensor
    ) -> tuple[Tensor, Tensor]:
        """(this layer's MLP output, the residual stream before it); the caller adds the two at the
        next norm, which fuses the add (residual is None on the first layer)."""
        if native_decode_applies(x, kv_cache, metadata):
            fused = self.native_decode_layer()
            if fused is not None:
                return fused(x, residual, cos, sin, kv_cache, metadata)
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos, sin, metadata, kv_cache)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual

    def native_decode_layer(self) -> native.DecodeLayer | None:
        """This layer as one native call per decode step (native.DecodeLayer), when all of it runs
        natively: a dense SwiGLU MLP, no q/k norm, fp32 norms, and its four Linears on the native
        kernels (GGUF blocks: Int4Linear w4a8 / Int8Linear w8a8). Built on first use and again when a
        Linear is swapped; it points into (and holds) the tensors it was built from, so a Linear whose
        buffers are replaced in place afterwards (not done by the engine) would not be seen."""
        attn, mlp = self.self_attn, self.mlp
        if not isinstance(mlp, GatedMLP) or attn.q_norm is not None:
            return None
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if self._native is not None and self._native.source == linears:
            return self._native
        norms = (self.input_layernorm, self.post_attention_layernorm)
        qkv, o, gate_up, down = (getattr(linear, "native_weight", lambda: None)() for linear in linears)
        if (qkv is None or o is None or gate_up is None or down is None
                or any(n.weight.dtype != torch.float32 for n in norms)):
            return None
        self._native = native.DecodeLayer(
            source=linears, heads=attn.num_heads, kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
            window=attn.window, scale=attn.scale, norms=((norms[0].weight, norms[0].eps), (norms[1].weight, norms[1].eps)),
            qkv=qkv, o=o, gate_up=gate_up, down=down)
        return self._native


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # Replaced by shard_model (a VocabParallelEmbedding, engine/parallel/layers.py).
        self.embed_tokens: nn.Module = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)

    def forward(
        self, input_ids: Tensor, positions: Tensor, metadata: AttentionMetadata, kv_caches: list[Tensor]
    ) -> Tensor:
        cos, sin = self.rotary(positions)  # once per step, shared by every layer
        x, residual = self.embed_tokens(input_ids), None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, cos, sin, metadata, kv_cache)
        return self.norm(x, residual)[0]


class CausalLM(nn.Module):
    # Set by engine.model.quantize.quantize_model, once it has quantised the layers (absent before).
    weight_dtype: QuantWeightDtype

    def __init__(self, config: ModelConfig) -> None:
        check_supported(config)
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        # Replaced by quantize_lm_head (an Int8Linear) or shard_model (a ParallelLMHead).
        self.lm_head: nn.Module = Linear(config.hidden_size, config.vocab_size)
        if config.tie_word_embeddings:
            embedding = self.model.embed_tokens
            assert isinstance(embedding, Embedding)  # as DecoderModel built it
            self.lm_head.weight = embedding.weight

    def forward(
        self, input_ids: Tensor, positions: Tensor, attn_metadata: AttentionMetadata, kv_caches: list[Tensor]
    ) -> Tensor:
        """input_ids, positions [T] -> final hidden states [T, H]; writes the step's K/V into kv_caches."""
        return self.model(input_ids, positions, attn_metadata, kv_caches)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden [N, H] (the rows to sample from) -> fp32 logits [N, V]."""
        return self.lm_head(hidden).float()

    def allocate_kv_caches(
        self, num_blocks: int, block_size: int, dtype: torch.dtype | None = None
    ) -> list[Tensor]:
        """One zeroed paged cache per layer, on the model's device and (by default) dtype."""
        weight = weight_of(self.lm_head)
        return allocate_kv_caches(self.config, num_blocks, block_size, dtype or weight.dtype, weight.device)
