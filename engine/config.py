"""ModelConfig: the architecture of a decoder-only LLM, read from a Hugging Face config.json.

Torch-free on purpose: the engine builds its modules from it, and the planner derives
parameter counts, KV-cache bytes and FLOPs from the very same object.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
import math
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from engine.core.scheduler import Batching, Policy, PreemptionMode, SchedulerConfig
from engine.dtypes import KV_DTYPE_BYTES, KV_SCALED_DTYPES, EngineDtype, QuantKVDtype, QuantWeightDtype
from engine.errors import InputError, from_validation_error
from engine.files import load_json
from engine.knobs import Knob

SUPPORTED_MODEL_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "deepseek_v3",
    "glm4_moe",
    "gpt_oss",
    "gemma2",
    "gemma3",
    "gemma3_text",
)

# 8-bit KV caches store an fp32 scale beside each token's vector of each KV head (engine/quant/kv.py).
KV_SCALE_BYTES = 4


# Bounds of a model config: generous beyond every published model (the largest hidden size is
# ~16k, the longest context ~10M tokens), so that a typo cannot make a plan or a random-weight
# engine size itself by it (docs/security.md).
MAX_LAYERS = 1024
MAX_HIDDEN = 1 << 17
MAX_HEADS = 4096
MAX_WIDTH = 1 << 20
MAX_VOCAB = 1 << 22
MAX_CONTEXT = 1 << 24
MAX_EXPERTS = 1 << 16
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "glm4_moe", "gpt_oss")


def _count(lo: int, hi: int, description: str) -> Any:
    return Field(None, strict=True, ge=lo, le=hi, description=description)


class HFConfigFields(BaseModel):
    """The config.json fields ServePlan reads, typed and bounded; every other key is left alone.

    Integers are strict (no "32", no 32.0, no true): a config that spells a size wrongly is
    refused rather than guessed at."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    num_hidden_layers: int = Field(strict=True, ge=1, le=MAX_LAYERS, description="Decoder layers")
    hidden_size: int = Field(strict=True, ge=1, le=MAX_HIDDEN, description="Residual stream width")
    num_attention_heads: int = Field(strict=True, ge=1, le=MAX_HEADS, description="Query heads")
    vocab_size: int = Field(strict=True, ge=1, le=MAX_VOCAB, description="Token ids")
    num_key_value_heads: int | None = _count(1, MAX_HEADS, "KV heads (absent: one per query head)")
    head_dim: int | None = _count(1, MAX_HEADS, "Width of one head (absent: hidden_size / num_attention_heads)")
    intermediate_size: int | None = _count(0, MAX_WIDTH, "Dense MLP width")
    moe_intermediate_size: int | None = _count(1, MAX_WIDTH, "Routed expert width")
    max_position_embeddings: int | None = _count(2, MAX_CONTEXT, "Longest context, tokens")
    num_local_experts: int | None = _count(0, MAX_EXPERTS, "Routed experts (Mixtral)")
    num_experts: int | None = _count(0, MAX_EXPERTS, "Routed experts (Qwen MoE, gpt-oss)")
    n_routed_experts: int | None = _count(0, MAX_EXPERTS, "Routed experts (DeepSeek, GLM-4.5)")
    num_experts_per_tok: int | None = _count(0, MAX_EXPERTS, "Experts per token")
    experts_per_token: int | None = _count(0, MAX_EXPERTS, "Experts per token (gpt-oss)")
    n_shared_experts: int | None = _count(0, MAX_EXPERTS, "Shared experts (DeepSeek, GLM-4.5)")
    shared_expert_intermediate_size: int | None = _count(0, MAX_WIDTH, "Shared expert width (Qwen MoE)")
    first_k_dense_replace: int | None = _count(0, MAX_LAYERS, "Leading dense layers (DeepSeek, GLM-4.5)")
    moe_layer_freq: int | None = _count(1, MAX_LAYERS, "Every n-th layer routed (DeepSeek)")
    decoder_sparse_step: int | None = _count(1, MAX_LAYERS, "Every n-th layer routed (Qwen MoE)")
    sliding_window: int | None = _count(0, MAX_CONTEXT, "Attention window, tokens (0: none)")
    sliding_window_pattern: int | None = _count(1, MAX_LAYERS, "Every n-th layer global (Gemma 3)")
    max_window_layers: int | None = _count(0, MAX_LAYERS, "Layers before windows start (Qwen)")
    q_lora_rank: int | None = _count(1, MAX_HIDDEN, "MLA query rank")
    kv_lora_rank: int | None = _count(1, MAX_HIDDEN, "MLA latent rank")
    qk_nope_head_dim: int | None = _count(1, MAX_HEADS, "MLA no-RoPE head width")
    qk_rope_head_dim: int | None = _count(1, MAX_HEADS, "MLA RoPE head width")
    v_head_dim: int | None = _count(1, MAX_HEADS, "MLA value head width")
    rms_norm_eps: float | None = Field(None, gt=0, le=1, description="RMSNorm epsilon")
    rope_theta: float | None = Field(None, gt=0, description="RoPE base")
    partial_rotary_factor: float | None = Field(None, gt=0, le=1, description="Share of each head RoPE rotates (GLM-4.5)")
    rope_parameters: dict[str, Any] | None = None
    rope_scaling: dict[str, Any] | None = None
    layer_types: list[str] | None = None
    mlp_only_layers: list[Annotated[int, Field(strict=True, ge=0)]] | None = None
    tie_word_embeddings: bool | None = None
    attention_bias: bool | None = None
    use_qk_norm: bool | None = None
    use_sliding_window: bool | None = None
    bos_token_id: int | None = Field(None, strict=True, ge=0)
    eos_token_id: Annotated[int, Field(strict=True, ge=0)] | list[Annotated[int, Field(strict=True, ge=0)]] | None = None


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    num_shared_experts: int = 0
    shared_expert_intermediate_size: int = 0
    router_bias: bool = False  # gpt-oss routers have a bias; DeepSeek and GLM-4.5 a score-correction bias
    expert_bias: bool = False  # gpt-oss experts carry biases on gate/up and down

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise InputError("num_experts", self.num_experts, "a mixture-of-experts model needs >= 1 routed expert")
        if not 1 <= self.top_k <= self.num_experts:
            raise InputError("num_experts_per_tok", self.top_k, f"must be in 1..num_experts={self.num_experts}")
        if self.expert_intermediate_size < 1:
            raise InputError("moe_intermediate_size", self.expert_intermediate_size, "must be >= 1")


@dataclass(frozen=True)
class MLAConfig:
    """DeepSeek multi-head latent attention: the KV cache holds one compressed latent per token."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP width (0 when every layer is MoE)
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False  # Qwen2: bias on q/k/v; gpt-oss: on q/k/v/o
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head
    norms_per_layer: int = 2  # Gemma 2/3 add post-attention and post-MLP norms
    attention_sinks: bool = False  # gpt-oss: one learned sink logit per head
    # Per layer: the attention window in tokens, or None for full attention.
    layer_windows: tuple[int | None, ...] = ()
    # Per layer: whether the MLP is routed experts (True) or dense (False).
    layer_is_moe: tuple[bool, ...] = ()
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None
    torch_dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "head_dim", "vocab_size",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InputError(name, value, "must be a positive integer")
        if self.num_attention_heads % self.num_kv_heads:
            raise InputError(
                "num_key_value_heads",
                self.num_kv_heads,
                f"must divide num_attention_heads={self.num_attention_heads}",
            )
        if len(self.layer_windows) != self.num_layers or len(self.layer_is_moe) != self.num_layers:
            raise InputError("num_hidden_layers", self.num_layers, "per-layer attributes must list every layer")
        if any(self.layer_is_moe) and self.moe is None:
            raise InputError("num_experts", None, "MoE layers need an expert count and top-k")
        if not all(self.layer_is_moe) and (not isinstance(self.intermediate_size, int) or self.intermediate_size < 1):
            raise InputError("intermediate_size", self.intermediate_size, "dense MLP layers need a width >= 1")

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_hf_config(cls, cfg: object, name: str = "") -> ModelConfig:
        """Build from the parsed contents of an HF config.json; every value read is checked first."""
        if not isinstance(cfg, dict):
            raise InputError("model", type(cfg).__name__, "a config.json must be a JSON object")
        if "text_config" in cfg:  # multimodal wrappers (Gemma 3): the decoder lives in text_config
            text = cfg["text_config"]
            if not isinstance(text, dict):
                raise InputError("text_config", type(text).__name__, "must be a JSON object")
            cfg = {**cfg, **text, "model_type": text.get("model_type", cfg.get("model_type"))}
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise InputError("model_type", model_type, f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        try:
            f = HFConfigFields.model_validate(cfg)
        except ValidationError as exc:
            raise from_validation_error(exc) from None

        num_heads = f.num_attention_heads
        if f.head_dim is None and f.hidden_size % num_heads:
            raise InputError("head_dim", None, f"absent, and hidden_size={f.hidden_size} is not a multiple of "
                             f"num_attention_heads={num_heads}")
        head_dim = f.head_dim or f.hidden_size // num_heads
        mla = _parse_mla(f) if model_type == "deepseek_v3" else None
        if mla is not None:  # MLA: a query/key head spans the no-RoPE and RoPE parts
            head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        rope = f.rope_parameters or {}  # transformers 5 folds rope_theta into rope_parameters
        rope_scaling = f.rope_scaling or (rope if rope.get("rope_type", "default") != "default" else None)
        eos = f.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        moe, layer_is_moe = _parse_moe(cfg, model_type, f.num_hidden_layers)
        return cls(
            model_type=model_type,
            num_layers=f.num_hidden_layers,
            hidden_size=f.hidden_size,
            num_attention_heads=num_heads,
            num_kv_heads=f.num_key_value_heads or num_heads,
            head_dim=head_dim,
            intermediate_size=(f.intermediate_size or 0) if not all(layer_is_moe) else 0,
            vocab_size=f.vocab_size,
            max_position_embeddings=f.max_position_embeddings or 2048,
            tie_word_embeddings=f.tie_word_embeddings if f.tie_word_embeddings is not None else model_type.startswith("gemma"),
            rms_norm_eps=f.rms_norm_eps or 1e-6,
            rope_theta=f.rope_theta or float(rope.get("rope_theta", 10000.0)),
            rope_scaling=rope_scaling,
            attention_bias=f.attention_bias if f.attention_bias is not None else model_type in ("qwen2", "qwen2_moe"),
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3", "gemma3_text") or bool(f.use_qk_norm),
            norms_per_layer=4 if model_type.startswith("gemma") else 2,
            attention_sinks=model_type == "gpt_oss",
            layer_windows=_parse_windows(cfg, model_type, f.num_hidden_layers),
            layer_is_moe=layer_is_moe,
            moe=moe,
            mla=mla,
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
            bos_token_id=f.bos_token_id,
            eos_token_ids=eos_ids,
            name=name,
            hf_config=cfg,
        )

    @classmethod
    def from_json_file(cls, path: str | Path, name: str = "") -> ModelConfig:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise InputError("model", str(path), "no such file (expected a config.json or a folder holding one)")
        # A regular file of at most MAX_CONFIG_BYTES, checked before reading: a FIFO or a device never ends.
        return cls.from_hf_config(load_json(path, "model", "MAX_CONFIG_BYTES"), name=name or path.parent.name)

    def first_layers(self, num_layers: int) -> ModelConfig:
        """The same model cut after its first `num_layers` layers (embedding, final norm and LM
        head kept): the early-exit self-speculative draft, for the engine and the cost model."""
        if not 1 <= num_layers <= self.num_layers:
            raise InputError("draft_layers", num_layers, f"must be in 1..{self.num_layers} (layers of {self.name or self.model_type})")
        return replace(self, num_layers=num_layers, layer_windows=self.layer_windows[:num_layers],
                       layer_is_moe=self.layer_is_moe[:num_layers], name=f"{self.name or self.model_type}[:{num_layers}]")

    # ------------------------------------------------------------------ parameters

    @property
    def rotary_dim(self) -> int:
        """Width of each query/key head that RoPE rotates: MLA's RoPE part, else head_dim x the config's
        partial_rotary_factor (GLM-4.5 rotates half of each head)."""
        if self.mla is not None:
            return self.mla.qk_rope_head_dim
        return int(self.head_dim * (self.hf_config.get("partial_rotary_factor") or 1.0))

    @property
    def is_moe(self) -> bool:
        return self.moe is not None and any(self.layer_is_moe)

    @property
    def num_moe_layers(self) -> int:
        return sum(self.layer_is_moe)

    def attention_params_per_layer(self) -> int:
        h = self.hidden_size
        if self.mla is not None:
            m, n = self.mla, self.num_attention_heads
            qk_dim = m.qk_nope_head_dim + m.qk_rope_head_dim
            q = h * n * qk_dim if m.q_lora_rank is None else h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * n * qk_dim
            kv = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank + m.kv_lora_rank * n * (m.qk_nope_head_dim + m.v_head_dim)
            return q + kv + n * m.v_head_dim * h
        q_dim = self.num_attention_heads * self.head_dim
        kv_dim = self.num_kv_heads * self.head_dim
        params = h * q_dim + 2 * h * kv_dim + q_dim * h
        if self.attention_bias:
            params += q_dim + 2 * kv_dim + (h if self.model_type == "gpt_oss" else 0)
        if self.qk_norm:
            params += 2 * self.head_dim
        if self.attention_sinks:
            params += self.num_attention_heads
        return params

    def expert_params(self) -> int:
        """Parameters of one routed expert (gated MLP)."""
        assert self.moe is not None
        h, i = self.hidden_size, self.moe.expert_intermediate_size
        return 3 * h * i + ((2 * i + h) if self.moe.expert_bias else 0)

    def _moe_layer_params(self, experts: int) -> int:
        assert self.moe is not None
        m, h = self.moe, self.hidden_size
        router = h * m.num_experts + (m.num_experts if m.router_bias else 0)
        shared = m.num_shared_experts * 3 * h * m.shared_expert_intermediate_size
        return router + experts * self.expert_params() + shared

    def dense_mlp_params(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size

    def layer_params(self, layer: int, experts_per_moe_layer: int | None = None) -> int:
        """Parameters of one decoder layer; MoE layers count `experts_per_moe_layer` experts (default all)."""
        params = self.attention_params_per_layer() + self.norms_per_layer * self.hidden_size
        if not self.layer_is_moe[layer]:
            return params + self.dense_mlp_params()
        assert self.moe is not None
        experts = self.moe.num_experts if experts_per_moe_layer is None else experts_per_moe_layer
        return params + self._moe_layer_params(experts)

    def _params(self, experts_per_moe_layer: int) -> int:
        total = sum(self.layer_params(i, experts_per_moe_layer) for i in range(self.num_layers))
        return total + self.embedding_params + self.lm_head_params + self.hidden_size  # + final norm

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        return self._params(self.moe.num_experts if self.moe else 0)

    @property
    def active_params(self) -> int:
        """Parameters touched per token: routed experts count top-k; embeddings included."""
        return self._params(self.moe.top_k if self.moe else 0)

    # ------------------------------------------------------------------ KV cache

    def kv_elements_per_token_per_layer(self) -> int:
        if self.mla is not None:  # the compressed latent plus the decoupled RoPE key
            return self.mla.kv_lora_rank + self.mla.qk_rope_head_dim
        return 2 * self.num_kv_heads * self.head_dim

    def kv_bytes_per_token_per_layer(self, kv_dtype: str = "bf16") -> int:
        """KV bytes of one token in one layer, with the scales a quantised cache keeps per token and head."""
        values = self.kv_elements_per_token_per_layer() * _kv_bytes(kv_dtype)
        if kv_dtype not in KV_SCALED_DTYPES:
            return values
        vectors = 1 if self.mla is not None else 2 * self.num_kv_heads  # the MLA latent is one vector
        return values + vectors * KV_SCALE_BYTES

    def kv_bytes_per_token(self, kv_dtype: str = "bf16") -> int:
        """KV bytes one token occupies across all layers while it is inside every window."""
        return self.num_layers * self.kv_bytes_per_token_per_layer(kv_dtype)

    def kv_bytes_for_sequence(self, num_tokens: int, kv_dtype: str = "bf16") -> int:
        """KV bytes a sequence of num_tokens holds; windowed layers keep only their window."""
        per_layer = self.kv_bytes_per_token_per_layer(kv_dtype)
        return sum(min(num_tokens, w) if w else num_tokens for w in self.layer_windows) * per_layer

    @property
    def num_full_attention_layers(self) -> int:
        return sum(1 for w in self.layer_windows if w is None)

    # ------------------------------------------------------------------ FLOPs

    def matmul_flops_per_token(self) -> int:
        """Forward FLOPs of the weight matmuls for one token (2 per multiply-add), LM head included."""
        matmul_params = self.active_params - self.embedding_params + (self.embedding_params if self.tie_word_embeddings else 0)
        return 2 * matmul_params

    def attention_flops_per_token(self, context_len: int) -> int:
        """Score and value FLOPs for one query token attending to context_len tokens."""
        if self.mla is not None:  # absorbed form: scores over the latent + rope dims, values over the latent
            m = self.mla
            per_position = 2 * self.num_attention_heads * (m.kv_lora_rank + m.qk_rope_head_dim + m.kv_lora_rank)
        else:
            per_position = 4 * self.num_attention_heads * self.head_dim
        return sum(per_position * (min(context_len, w) if w else context_len) for w in self.layer_windows)

    def flops_per_token(self, context_len: int) -> int:
        return self.matmul_flops_per_token() + self.attention_flops_per_token(context_len)


class SpeculativeSettings(BaseModel):
    """Speculative decoding: one definition for the engine (which runs it) and the simulator
    (which draws acceptance from `acceptance_probabilities()`). See docs/speculative.md."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    method: Literal["ngram", "draft", "self"] = Field(description="Proposer: n-gram lookup, draft model or early-exit self-draft")
    num_speculative_tokens: int = Field(ge=1, le=16, description="Draft tokens proposed per step (k)")
    draft_model: str | None = Field(None, description="Catalog name, checkpoint folder or .gguf of the draft model, for method='draft'")
    draft_layers: int | None = Field(
        None, ge=1, description="Target layers the self-speculative draft runs before exiting, for method='self'"
    )
    ngram_min_n: int = Field(2, ge=1, le=64, description="Shortest suffix n-gram looked up in prompt + output, for method='ngram'")
    ngram_max_n: int = Field(4, ge=1, le=64, description="Longest suffix n-gram looked up (tried first), for method='ngram'")
    acceptance_rate: float | None = Field(
        None, gt=0, le=1, description="Per-position acceptance probability when no measured profile is given"
    )
    acceptance_profile: tuple[float, ...] | None = Field(
        None,
        description="Simulator: per draft position i, probability that it is accepted given that drafts were "
        "proposed and all before it accepted (k entries in [0, 1]; measured as llm.spec_stats.acceptance_profile)",
    )
    proposal_rate: float = Field(
        1.0, ge=0, le=1,
        description="Simulator: share of decoding steps in which a request gets drafts at all (n-gram lookups can "
        "miss; model drafts always propose; measured as llm.spec_stats.proposal_rate)",
    )

    @model_validator(mode="after")
    def _consistent(self) -> SpeculativeSettings:
        if self.method == "draft" and not self.draft_model:
            raise ValueError("method='draft' needs draft_model (a catalog name or checkpoint of the draft)")
        if self.method == "self" and self.draft_layers is None:
            raise ValueError("method='self' needs draft_layers (how many target layers the draft runs)")
        if self.ngram_min_n > self.ngram_max_n:
            raise ValueError(f"ngram_min_n={self.ngram_min_n} must be <= ngram_max_n={self.ngram_max_n}")
        profile = self.acceptance_profile
        if profile is not None:
            if len(profile) != self.num_speculative_tokens:
                raise ValueError(f"acceptance_profile has {len(profile)} entries; it needs one per draft position "
                                 f"(num_speculative_tokens={self.num_speculative_tokens})")
            if not all(0.0 <= a <= 1.0 for a in profile):  # also rejects NaN
                raise ValueError(f"acceptance_profile={profile} must hold probabilities in [0, 1]")
        return self

    def acceptance_probabilities(self) -> tuple[float, ...] | None:
        """Per-position conditional acceptance for the simulator: the profile, else the constant
        rate at every position, else None (nothing to simulate with)."""
        if self.acceptance_profile is not None:
            return self.acceptance_profile
        if self.acceptance_rate is not None:
            return (self.acceptance_rate,) * self.num_speculative_tokens
        return None


# Upper bounds of the engine knobs: far beyond any serving engine's setting, low enough that no
# simulated or real step is sized by a typo (docs/security.md lists every limit).
MAX_BATCHED_TOKENS = 1 << 20
MAX_NUM_SEQS = 1 << 16
MAX_OFFLOAD_GIB = 1 << 20  # 1 PiB of host memory or disk per engine instance


# Largest explicit KV cache: 16 TiB or 16M blocks, beyond any machine, well short of an overflow.
MAX_KV_CACHE_GIB = 16384
MAX_KV_BLOCKS = 1 << 24


class EngineKnobs(BaseModel):
    """Engine settings that change scheduling and memory: one definition for engine and simulator,
    from which the CLI flags and the dashboard widgets are generated (engine/knobs.py).

    A setting left None is the serving engine's own default, as vLLM's EngineArgs leave theirs
    unset until the device and usage are known: ServePlan's engine fills them from ENGINE_DEFAULTS,
    the planner from the chosen engine profile (planner/engines) for the hardware at hand.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    block_size_tokens: Annotated[int | None, Knob("--block-size", "KV block size", "tokens")] = Field(
        None, ge=1, le=1024, description="Tokens per KV-cache block (default: the engine's)")
    max_num_batched_tokens: Annotated[int | None, Knob("--max-num-batched-tokens", "Token budget per step", "tokens")] = Field(
        None, ge=1, le=MAX_BATCHED_TOKENS,
        description="Token budget per engine step, prefill + decode + speculative (default: the engine's for the device)")
    max_num_seqs: Annotated[int | None, Knob("--max-num-seqs", "Max running requests", "requests")] = Field(
        None, ge=1, le=MAX_NUM_SEQS, description="Most requests running at once (default: the engine's for the device)")
    enable_chunked_prefill: Annotated[bool | None, Knob("--chunked-prefill", "Chunked prefill")] = Field(
        None, description="Split long prompts across steps to fit the token budget (default: the engine's)")
    enable_prefix_caching: Annotated[bool | None, Knob("--prefix-caching", "Prefix caching")] = Field(
        None, description="Share KV blocks of equal prefixes across requests (default: the engine's)")
    policy: Annotated[Policy, Knob("--policy", "Scheduling policy")] = Field(
        "fcfs", description="Admission and preemption order: first come first served, or by priority")
    batching: Annotated[Batching | None, Knob("--batching", "Batching")] = Field(
        None, description="mixed: decodes and prefill chunks share a step; prefill_first: a step prefills only while "
        "prompts wait (default: the engine's)")
    num_scheduler_steps: Annotated[int | None, Knob("--num-scheduler-steps", "Decode steps per schedule", "steps")] = Field(
        None, ge=1, le=64, description="Decode steps run per scheduling decision, vLLM 0.6's multi-step (default: 1)")
    gpu_memory_utilization: Annotated[float | None, Knob("--gpu-memory-utilization", "GPU memory utilisation", "share")] = Field(
        None, gt=0, le=1,
        description="Share of device memory the engine may use for weights, activations and KV cache (default: the engine's)")
    kv_cache_gib: Annotated[float | None, Knob("--kv-cache-gib", "KV-cache size", "GiB per GPU")] = Field(
        None, gt=0, le=MAX_KV_CACHE_GIB,
        description="KV-cache memory per GPU, in place of what gpu_memory_utilization leaves (vLLM --kv-cache-memory); "
        "default: the engine's rule (ServePlan's engine: gpu_memory_utilization of free memory on CUDA, 1 GiB on CPU)")
    speculative: SpeculativeSettings | None = None
    enforce_eager: Annotated[bool, Knob("--enforce-eager", "Eager only (no CUDA graphs)")] = Field(
        False, description="Launch every kernel of every step; otherwise decode-only steps replay a captured graph "
        "(CUDA devices; other devices always run eagerly)")
    max_graph_batch_size: Annotated[int | None, Knob("--max-graph-batch-size", "Largest graph batch", "requests")] = Field(
        None, ge=1, le=4096,
        description="Largest decode batch run as a captured graph; larger batches run eagerly (default: the engine's)")
    preemption_mode: Annotated[PreemptionMode, Knob("--preemption-mode", "Preemption")] = Field(
        "recompute", description="What a preempted request loses: recompute drops its KV and prefills again on resume; "
        "swap copies its blocks to the host KV tier and back (recompute when the tier has no room)")
    kv_offload_host_gib: Annotated[float, Knob("--kv-offload-host-gib", "Host KV tier", "GiB")] = Field(
        0.0, ge=0, le=MAX_OFFLOAD_GIB, description="Host memory for KV blocks, per engine instance (all its GPUs): "
        "prefix-cache blocks evicted from device memory (LRU) and swapped-out requests; 0: none (docs/offload.md)")
    kv_offload_disk_gib: Annotated[float, Knob("--kv-offload-disk-gib", "Disk KV tier", "GiB")] = Field(
        0.0, ge=0, le=MAX_OFFLOAD_GIB, description="Local disk for prefix-cache blocks the host tier evicts (LRU), "
        "per engine instance; needs a host tier; 0: none")

    @model_validator(mode="after")
    def _tiers_in_order(self) -> EngineKnobs:
        if self.kv_offload_disk_gib and not self.kv_offload_host_gib:
            raise InputError("kv_offload_disk_gib", self.kv_offload_disk_gib,
                             "needs kv_offload_host_gib > 0: blocks reach the disk tier through host memory")
        if self.preemption_mode == "swap" and not self.kv_offload_host_gib:
            raise InputError("preemption_mode", "swap", "needs kv_offload_host_gib > 0: swapped blocks live in the host tier")
        return self

    def with_defaults(self, defaults: EngineChoices) -> EngineKnobs:
        """These knobs with every setting left None taken from `defaults` (an engine's)."""
        missing = {name: getattr(defaults, name) for name in ENGINE_CHOSEN if getattr(self, name) is None}
        return self.model_copy(update=missing) if missing else self

    @property
    def resolved(self) -> bool:
        return all(getattr(self, name) is not None for name in ENGINE_CHOSEN)

    @property
    def choices(self) -> EngineChoices:
        """The settings left to the engine, now that every one is set (with_defaults)."""
        unset = [name for name in ENGINE_CHOSEN if getattr(self, name) is None]
        if unset:
            raise InputError("engine knobs", ", ".join(unset), "need the serving engine's defaults first "
                             "(EngineKnobs.with_defaults, or planner.engines.resolve_deployment)")
        return EngineChoices(**{name: getattr(self, name) for name in ENGINE_CHOSEN})

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        c = self.choices
        return SchedulerConfig(
            max_num_batched_tokens=c.max_num_batched_tokens,
            max_num_seqs=c.max_num_seqs,
            max_model_len=max_model_len,
            block_size=c.block_size_tokens,
            enable_chunked_prefill=c.enable_chunked_prefill,
            enable_prefix_caching=c.enable_prefix_caching,
            policy=self.policy,
            num_speculative_tokens=self.speculative.num_speculative_tokens if self.speculative else 0,
            batching=c.batching,
            num_scheduler_steps=c.num_scheduler_steps,
            preemption_mode=self.preemption_mode,
        )


@dataclass(frozen=True)
class EngineChoices:
    """The EngineKnobs an engine chooses itself when they are left None, each one decided: an
    engine's defaults (ENGINE_DEFAULTS, an engine profile's knob_defaults), and what the engine and
    the cost model read of a resolved configuration (EngineKnobs.choices), so none of them checks for None."""

    block_size_tokens: int
    max_num_batched_tokens: int
    max_num_seqs: int
    enable_chunked_prefill: bool
    enable_prefix_caching: bool
    batching: Batching
    num_scheduler_steps: int
    gpu_memory_utilization: float
    max_graph_batch_size: int


ENGINE_CHOSEN = tuple(f.name for f in fields(EngineChoices))


# ServePlan's own engine's defaults for every knob an engine chooses (planner/engines/serveplan.yaml
# states the same, and a test keeps them equal).
ENGINE_DEFAULTS = EngineChoices(
    block_size_tokens=16,
    max_num_batched_tokens=8192,
    max_num_seqs=256,
    enable_chunked_prefill=True,
    enable_prefix_caching=True,
    batching="mixed",
    num_scheduler_steps=1,
    gpu_memory_utilization=0.9,
    max_graph_batch_size=512,
)


def tier_blocks(gib: float, block_bytes: float) -> int:
    """KV blocks of `block_bytes` that an offload tier of `gib` GiB holds (engine and simulator
    alike). A size given as a whole number of blocks (blocks x block_bytes / 2^30) gives that
    number back despite float rounding."""
    return math.floor(gib * 2**30 / block_bytes + 1e-9)


# Most processes one engine splits a model across (engine/parallel): a node's GPUs many times over.
MAX_PARALLEL = 64


class EngineConfig(EngineKnobs):
    """Engine knobs plus what only a real engine needs: device, precision, KV-cache size, seed."""

    device: Annotated[str, Knob("--device", "Device")] = Field(
        "auto", pattern=r"^(auto|cpu|cuda(:\d{1,3})?)$",
        description="'auto' (CUDA when present, else CPU), 'cpu', 'cuda' or 'cuda:N'")
    dtype: Annotated[EngineDtype, Knob("--dtype", "Compute dtype")] = Field(
        "float32", description="Weights and activations")
    num_kv_blocks: Annotated[int | None, Knob("--num-kv-blocks", "KV blocks", "blocks")] = Field(
        None, ge=1, le=MAX_KV_BLOCKS, description="Exact KV block count (overrides kv_cache_gib)")
    max_model_len: Annotated[int | None, Knob("--max-model-len", "Max model length", "tokens")] = Field(
        None, ge=2, le=MAX_CONTEXT, description="Longest prompt + output; default: the model's context")
    seed: int = Field(0, ge=0, description="Seed for random weights and for requests without their own seed")
    random_weights: Annotated[bool, Knob("--random-weights", "Random weights")] = Field(
        False, description="Initialise from the config with random weights (no checkpoint)")
    weight_dtype: Annotated[Literal["auto", QuantWeightDtype], Knob("--weight-dtype", "Weight quantisation")] = Field(
        "auto", description="Transformer-layer Linear weights: 'auto' = dtype (no quantisation), int8, int4 or fp8")
    kv_cache_dtype: Annotated[Literal["auto", QuantKVDtype], Knob("--kv-cache-dtype", "KV-cache format")] = Field(
        "auto", description="KV-cache values: 'auto' = dtype, or int8 / fp8 with a scale per (token, head)")
    compile_model: Annotated[bool, Knob("--compile-model", "torch.compile")] = Field(
        False, description="torch.compile the decode step once per captured batch size (then CUDA-graph it on CUDA)")
    int8_kernel: Annotated[Literal["auto", "dynamic"], Knob("--int8-kernel", "int8 kernel")] = Field(
        "auto", description="int8 weights: 'auto' = weight-only (Triton on CUDA; on CPUs torch's packed kernel, run "
        "in bf16, where it is vectorised, else dequantise then matmul), 'dynamic' = CPU only, W8A8 quantising each "
        "token's activations on each call (the native kernel, 8 bits, on AVX-512 VNNI / AMX CPUs; else fbgemm's, "
        "7 bits): the fast int8 path at batch > 1, at a further quality cost"
    )
    kv_offload_disk_path: Annotated[str | None, Knob("--kv-offload-disk-path", "Disk KV tier folder")] = Field(
        None, min_length=1, max_length=4096, description="Existing folder where the disk KV tier keeps its file "
        "(created and removed by the engine); needed with kv_offload_disk_gib")
    lm_head_dtype: Annotated[Literal["auto", "int8"], Knob("--lm-head-dtype", "LM head format")] = Field(
        "auto", description="The LM head's weight: 'auto' = dtype; 'int8' = per output channel, run on a CPU by "
        "the 'dynamic' W8A8 matmul (activations per token). It is the largest matmul of a small model; "
        "the planner's memory model counts it unquantised (a tied embedding keeps its float copy)")
    threads: Annotated[int | None, Knob("--threads", "CPU threads", "threads")] = Field(
        None, ge=1, le=4096, description="Threads of torch's CPU pool, set when the engine starts on a CPU; unset: "
        "as this process has it. The CLI defaults to OMP_NUM_THREADS, else the physical cores this process may "
        "run on (engine/cpu.py)")

    tensor_parallel: Annotated[int, Knob("--tp", "Tensor parallel", "processes")] = Field(
        1, ge=1, le=MAX_PARALLEL, description="Processes (one per CPU share or GPU) every layer is split across: each "
        "holds 1/N of the weights and KV heads, and the layers all-reduce (engine/parallel); at 1 with "
        "expert_parallel N, N")
    expert_parallel: Annotated[int, Knob("--ep", "Expert parallel", "processes")] = Field(
        1, ge=1, le=MAX_PARALLEL, description="MoE models: place whole experts on the tensor-parallel ranks and send "
        "tokens to them by all-to-all, on 1 (experts split by width) or all tensor_parallel ranks")

    @model_validator(mode="before")
    @classmethod
    def _engine_defaults(cls, data: object) -> object:
        """ServePlan's engine is the engine here: what is left unset takes its defaults. Expert
        parallelism needs as many processes as it places experts on: --ep N alone runs N."""
        if isinstance(data, dict):
            data = {**data, **{k: v for k, v in asdict(ENGINE_DEFAULTS).items() if data.get(k) is None}}
            if data.get("tensor_parallel") in (None, 1) and isinstance(data.get("expert_parallel"), int):
                data["tensor_parallel"] = data["expert_parallel"]
        return data

    @field_validator("expert_parallel")
    @classmethod
    def _experts_on_every_rank(cls, ep: int, info: ValidationInfo) -> int:
        tp = info.data.get("tensor_parallel")
        if ep > 1 and tp is not None and ep != tp:
            raise ValueError(f"the engine places experts on every tensor-parallel rank or on none: 1 or {tp}")
        return ep
    @model_validator(mode="after")
    def _offload_tiers_are_usable(self) -> EngineConfig:
        if self.kv_offload_disk_gib and self.kv_offload_disk_path is None:
            raise InputError("kv_offload_disk_path", None, "needs a folder for the disk KV tier (kv_offload_disk_gib > 0)")
        if self.kv_offload_host_gib and self.tensor_parallel > 1:
            raise InputError("kv_offload_host_gib", self.kv_offload_host_gib,
                             "offload tiers live in one process's runner: 0 with tensor_parallel > 1")
        return self

    @field_validator("int8_kernel")
    @classmethod
    def _int8_kernel_applies(cls, kernel: str, info: ValidationInfo) -> str:
        weight_dtype = info.data.get("weight_dtype")
        if kernel == "dynamic" and weight_dtype != "int8":
            raise ValueError(f"'dynamic' needs weight_dtype='int8', got {weight_dtype!r}")
        return kernel


def graph_capture_sizes(max_graph_batch_size: int) -> tuple[int, ...]:
    """Decode batch sizes captured as graphs: 1, 2, 4, then every multiple of 8 up to the maximum
    (vLLM's spacing: padding a batch wastes at most 7 rows, and few graphs keep capture short)."""
    sizes = [b for b in (1, 2, 4) if b <= max_graph_batch_size]
    sizes += range(8, max_graph_batch_size + 1, 8)
    if sizes[-1] != max_graph_batch_size:
        sizes.append(max_graph_batch_size)
    return tuple(sizes)


def graph_batch_size(num_seqs: int, max_graph_batch_size: int) -> int | None:
    """The captured size a decode batch of num_seqs is padded to, or None when it runs eagerly."""
    if not 0 < num_seqs <= max_graph_batch_size:
        return None
    # Arithmetic form of graph_capture_sizes (it runs every simulated step); the maximum is always captured.
    padded = 1 << (num_seqs - 1).bit_length() if num_seqs <= 4 else -(-num_seqs // 8) * 8
    return min(padded, max_graph_batch_size)


def _kv_bytes(kv_dtype: str) -> int:
    if kv_dtype not in KV_DTYPE_BYTES:
        raise InputError("kv_dtype", kv_dtype, f"allowed: {', '.join(KV_DTYPE_BYTES)}")
    return KV_DTYPE_BYTES[kv_dtype]


def _parse_windows(cfg: dict[str, Any], model_type: str, num_layers: int) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window")
    layer_types = cfg.get("layer_types")
    if layer_types:
        if len(layer_types) != num_layers:
            raise InputError("layer_types", f"{len(layer_types)} entries", f"must list all {num_layers} layers")
        if "sliding_attention" in layer_types and not window:
            raise InputError("sliding_window", window, "layer_types names sliding_attention layers: needs a window >= 1")
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if not window:
        return (None,) * num_layers
    if model_type == "gemma2":  # even layers are local, odd layers global
        return tuple(window if i % 2 == 0 else None for i in range(num_layers))
    if model_type in ("gemma3", "gemma3_text"):  # every pattern-th layer is global
        pattern = cfg.get("sliding_window_pattern") or 6
        return tuple(window if (i + 1) % pattern else None for i in range(num_layers))
    if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        if not cfg.get("use_sliding_window", False):
            return (None,) * num_layers
        first = cfg.get("max_window_layers")
        first = num_layers if first is None else first
        return tuple(window if i >= first else None for i in range(num_layers))
    return (window,) * num_layers  # Mistral: every layer windowed


def _parse_moe(cfg: dict[str, Any], model_type: str, num_layers: int) -> tuple[MoEConfig | None, tuple[bool, ...]]:
    key = next((k for k in ("num_local_experts", "num_experts", "n_routed_experts") if cfg.get(k) is not None), None)
    num_experts = cfg[key] if key else 0
    if not num_experts:
        if model_type in MOE_MODEL_TYPES:  # 0 experts would silently make it a dense model
            raise InputError(key or "num_experts", num_experts if key else None,
                             f"a {model_type} model routes to experts: needs >= 1")
        return None, (False,) * num_layers
    if model_type in ("deepseek_v3", "glm4_moe"):  # GLM-4.5 routes as DeepSeek-V3 does, with GQA attention
        first_dense = cfg.get("first_k_dense_replace") or 0
        freq = cfg.get("moe_layer_freq") or 1
        is_moe = tuple(i >= first_dense and i % freq == 0 for i in range(num_layers))
        shared, shared_size = cfg.get("n_shared_experts") or 0, cfg.get("moe_intermediate_size") or 0
    elif model_type in ("qwen2_moe", "qwen3_moe"):
        step = cfg.get("decoder_sparse_step") or 1
        dense_layers = set(cfg.get("mlp_only_layers") or [])
        is_moe = tuple(i not in dense_layers and (i + 1) % step == 0 for i in range(num_layers))
        shared_size = cfg.get("shared_expert_intermediate_size") or 0
        shared = 1 if shared_size else 0
    else:  # mixtral, gpt_oss: every layer routed
        is_moe = (True,) * num_layers
        shared, shared_size = 0, 0
    moe = MoEConfig(
        num_experts=num_experts,
        top_k=cfg.get("num_experts_per_tok") or cfg.get("experts_per_token") or 0,
        expert_intermediate_size=cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 0,
        num_shared_experts=shared,
        shared_expert_intermediate_size=shared_size,
        router_bias=model_type in ("gpt_oss", "deepseek_v3", "glm4_moe"),
        expert_bias=model_type == "gpt_oss",
    )
    return moe, is_moe


def _parse_mla(f: HFConfigFields) -> MLAConfig:
    ranks = {k: getattr(f, k) for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}
    for key, value in ranks.items():
        if value is None:
            raise InputError(key, None, "missing: DeepSeek's multi-head latent attention needs it")
    return MLAConfig(q_lora_rank=f.q_lora_rank, **ranks)
