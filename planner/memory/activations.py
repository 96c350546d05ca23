"""Activation memory: the peak of the profiling pass some engines run before sizing the KV cache, the
sampler's buffers when that pass samples, and what a step or a captured graph needs at run time.

vLLM runs one forward pass over its whole token budget (max_num_batched_tokens split into
min(max_num_seqs, budget) dummy requests), then samples one row of logits per request with top-k and
top-p set, and reserves the allocator's peak. With 1024 requests and a 150k vocabulary the sampler,
not the forward pass, sets that peak: its buffers are counted here tensor by tensor from the code.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import ModelConfig
from planner.engines import EngineProfile
from planner.memory.parts import Part, gib
from planner.specs import Deployment, ProfileSampler

# vLLM's fused MoE processes at most this many tokens at once (VLLM_FUSED_MOE_CHUNK_SIZE).
FUSED_MOE_CHUNK_TOKENS = 64 * 1024
FORWARD_SOURCE = ("planner/memory/activations.py: the live tensors of the largest layer phase with fused norms "
                  "and SwiGLU (residual + normed input + gate_up + activation output, or the fused-MoE "
                  "intermediate caches, https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/model_executor/"
                  "layers/fused_moe/fused_moe.py)")
SERVEPLAN_FORWARD_SOURCE = ("engine/model/decoder.py, engine/model/layers.py, engine/runner.py: the tensors alive "
                            "during a step of ServePlan's engine, traced through its code")
DUMMY_RUN_SOURCE = "https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/v1/worker/gpu_model_runner.py#L2897-L3255"


@dataclass(frozen=True)
class Sampler:
    """A top-k/top-p sampler's buffers per logit (one request's row x one vocabulary entry), phase by phase:
    the tensors alive together; the peak is the largest phase."""

    description: str
    phases: tuple[tuple[tuple[str, int], ...], ...]
    source: str

    @property
    def bytes_per_logit(self) -> int:
        return max(sum(size for _, size in phase) for phase in self.phases)

    def peak_phase(self) -> tuple[tuple[str, int], ...]:
        return max(self.phases, key=lambda phase: sum(size for _, size in phase))


_LOGITS = (("bf16 logits", 2), ("fp32 logits", 4))
_SORTED = (("sorted values (fp32)", 4), ("sorted indices (int64)", 8))
SAMPLERS: dict[ProfileSampler, Sampler] = {
    # torch.sort on CUDA sorts segments with cub's radix sort: an int64 row index per element plus the
    # radix sort's alternate key and value buffers (aten/src/ATen/native/cuda/Sort.cu segmented_sort_pairs).
    "torch_sort": Sampler(
        "PyTorch top-k/top-p: sort the fp32 logits, mask, scatter back",
        ((*_LOGITS, *_SORTED, ("sort scratch: int64 positions", 8), ("sort scratch: radix alternate keys + values", 12)),),
        "https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/v1/sample/ops/topk_topp_sampler.py#L164-L204 "
        "(logits.to(float32): v1/sample/sampler.py#L86; sort scratch: pytorch aten/src/ATen/native/cuda/Sort.cu)",
    ),
    "torch_sort_gather": Sampler(
        "vLLM V0 top-k/top-p: sort, mask, invert the permutation and gather back",
        ((*_LOGITS, *_SORTED, ("sort scratch: int64 positions", 8), ("sort scratch: radix alternate keys + values", 12)),
         (*_LOGITS, *_SORTED, ("top-k mask", 1), ("sorted probabilities", 4), ("cumulative sums", 4),
          ("top-p mask", 1), ("inverse permutation (int64)", 8), ("re-gathered logits", 4))),
        "https://github.com/vllm-project/vllm/blob/v0.6.0/vllm/model_executor/layers/sampler.py#L418-L447",
    ),
    "flashinfer": Sampler(
        "FlashInfer top-k/top-p from logits: mask the top-k without sorting, softmax, rejection sampling",
        ((*_LOGITS, ("top-k masked logits", 4), ("probabilities", 4)),),
        "https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/v1/sample/ops/topk_topp_sampler.py#L256-L292 "
        "(flashinfer.sampling.top_k_top_p_sampling_from_logits: top_k_mask_logits, then softmax)",
    ),
}


def profiling_pass(model: ModelConfig, dep: Deployment, engine: EngineProfile, sampler: ProfileSampler | None,
                   *, samples: bool = True) -> list[Part]:
    """The activation peak of the engine's profiling pass at its token budget (engines without one: the peak
    of a step at the budget, which must fit outside the KV cache). Only the last pipeline stage samples."""
    knobs, tp = dep.knobs.choices, dep.tensor_parallel
    tokens = knobs.max_num_batched_tokens
    act = _act_bytes(dep)
    in_budget = engine.memory.activation_profile == "budget"
    if engine.engine == "serveplan":
        rows = min(knobs.max_num_seqs, tokens)
        return [_serveplan_step(model, tokens, rows, act)]
    forward, forward_rule = fused_forward_bytes(model, tp, tokens, act)
    label = "activation peak: forward pass" if in_budget else "activations of a step"
    where = "the profiling pass" if in_budget else "a step"
    forward_part = Part("activation.forward", label, forward,
                        f"{where} at max_num_batched_tokens={tokens}: {forward_rule}", FORWARD_SOURCE, in_budget)
    if not (engine.memory.sampler_in_profile and samples):
        return [forward_part]
    kind = sampler or engine.memory.sampler
    assert kind is not None  # the profile schema sets a sampler exactly when the pass samples
    rows = min(knobs.max_num_seqs, tokens)
    sampling, sampling_rule = sampler_phase_bytes(model, tokens, rows, act, SAMPLERS[kind])
    if sampling <= forward:
        return [forward_part]
    return [Part("activation.sampler", "activation peak: sampler of the profiling pass", sampling,
                 f"{sampling_rule} (> forward pass {gib(forward)})",
                 f"{SAMPLERS[kind].source}; dummy run: {DUMMY_RUN_SOURCE}", in_budget)]


def sampler_phase_bytes(model: ModelConfig, tokens: int, rows: int, act: float, sampler: Sampler) -> tuple[float, str]:
    """The dummy run's hidden states stay alive while `rows` requests sample: hidden [tokens, H], the sampled
    rows and their random replacement [rows, H] each, and the sampler's buffers [rows, vocab]."""
    h = model.hidden_size
    held = tokens * h * act + 2 * rows * h * act
    logits = rows * model.vocab_size * sampler.bytes_per_logit
    buffers = " + ".join(f"{size} ({name})" for name, size in sampler.peak_phase())
    return held + logits, (f"{rows} rows x {model.vocab_size:,} vocab x {sampler.bytes_per_logit} B/logit "
                           f"({sampler.description}: {buffers}) + hidden states held {gib(held)}")


def fused_forward_bytes(model: ModelConfig, tp: int, tokens: int, act: float) -> tuple[float, str]:
    """Peak live activations of one forward pass over `tokens` with fused norm and SwiGLU kernels, per GPU."""
    h = model.hidden_size
    stream = 2 * h  # residual stream and the normed input of the current block
    if model.mla is not None:
        m, n = model.mla, model.num_attention_heads / tp
        attention = n * (m.qk_nope_head_dim + m.qk_rope_head_dim) + (m.kv_lora_rank + m.qk_rope_head_dim) \
            + n * (m.qk_nope_head_dim + m.v_head_dim) + n * m.v_head_dim
    else:
        q = model.num_attention_heads * model.head_dim / tp
        kv = max(1, model.num_kv_heads // tp) * model.head_dim
        attention = q + 2 * kv + q  # qkv projection output, then the attention output
    widths = {"attention": attention}
    if not all(model.layer_is_moe):
        widths["MLP"] = 3 * model.intermediate_size / tp  # gate_up output, then the activation output
    per_token = {name: (stream + width) * tokens * act for name, width in widths.items()}
    if model.is_moe:
        assert model.moe is not None
        moe = model.moe
        chunk = min(tokens, FUSED_MOE_CHUNK_TOKENS)
        # fused_moe's intermediate caches: [T, k, 2I] gate_up, [T*k, I] activation, [T, k, H] outputs.
        caches = chunk * moe.top_k * (3 * moe.expert_intermediate_size / tp + h) * act
        shared = 3 * moe.num_shared_experts * moe.shared_expert_intermediate_size / tp * tokens * act
        router = tokens * moe.num_experts * 4  # fp32 router logits
        per_token["MoE"] = stream * tokens * act + caches + shared + router
    phase = max(per_token, key=lambda k: per_token[k])
    return per_token[phase], f"{phase} phase of {tokens} tokens, {gib(per_token[phase])}"


def _serveplan_step(model: ModelConfig, tokens: int, rows: int, act: float) -> Part:
    """A step of ServePlan's own engine at its token budget, tensor by tensor from its code."""
    peak, rule = serveplan_step_bytes(model, tokens, rows, act)
    return Part("activation.step", "activations of a step", peak, rule, SERVEPLAN_FORWARD_SOURCE,
                in_budget=False)


def serveplan_step_bytes(model: ModelConfig, tokens: int, rows: int, act: float) -> tuple[float, str]:
    """Peak live tensors of one step of ServePlan's engine over `tokens` tokens of which `rows` sample.

    During layer n the decoder loop still holds its input x and residual, the layer has made a new
    residual and a normed copy (4 x [T, H]); the dense MLP adds gate_up [T, 2I], silu(gate) [T, I]
    and their product [T, I]. Attention adds qkv, the rotated q and k, and the output. cos and sin
    [T, head_dim] (fp32) and the int64 token ids, positions and slot mapping live for the whole step.
    Sampling holds the final hidden states, the sampled rows, and their logits in bf16 and fp32.
    """
    h, d = model.hidden_size, model.head_dim
    q, kv = model.num_attention_heads * d, model.num_kv_heads * d
    held = tokens * (2 * d * 4 + 3 * 8)  # cos, sin (fp32) and ids, positions, slot mapping (int64)
    phases = {"attention": tokens * (4 * h + (q + 2 * kv) + (q + kv) + 2 * q) * act}
    if not all(model.layer_is_moe):
        phases["MLP"] = tokens * (4 * h + 4 * model.intermediate_size) * act
    if model.is_moe:
        assert model.moe is not None
        k = model.moe.top_k
        phases["MoE"] = tokens * (4 * h + 3 * k * h) * act + tokens * model.moe.num_experts * 4 * 2
    phases["sampling"] = (tokens * h + rows * h) * act + rows * model.vocab_size * (2 + 4)
    phase = max(phases, key=lambda p: phases[p])
    return held + phases[phase], (f"{phase} phase of a step of {tokens} tokens ({rows} sampled): "
                                  f"{gib(phases[phase])} + step inputs and rotary tables {gib(held)}")


def graph_pool(model: ModelConfig, dep: Deployment, engine: EngineProfile, captures: bool) -> list[Part]:
    """CUDA graphs share one memory pool sized by the largest captured batch's activations; the engine
    captures after sizing the KV cache unless its profile says it takes graphs from the budget."""
    if not captures:
        return []
    batch = dep.knobs.choices.max_graph_batch_size
    pool, rule = fused_forward_bytes(model, dep.tensor_parallel, batch, _act_bytes(dep))
    return [Part("graphs.pool", "CUDA graphs", pool, f"estimate: the pool of the largest captured batch ({batch}): {rule}",
                 "estimate: captured graphs share one memory pool; the per-graph executable memory is not "
                 "modelled", engine.memory.cuda_graph_in_budget)]


def _act_bytes(dep: Deployment) -> float:
    return 4.0 if dep.weight_dtype == "fp32" else 2.0
