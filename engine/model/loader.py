"""One entry point from a model source to a ready CausalLM: `load_model`.

Sources: an HF checkpoint folder (config.json + safetensors, sharded or not), a .gguf file,
the catalog name of a model whose weights ship in a package (smollm2-135m), or any catalog
name / config.json with random_weights=True. Every bad input is an InputError that names
the file or tensor at fault.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
import re
from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor

from engine.catalog import resolve_model
from engine.config import ModelConfig
from engine.errors import InputError
from engine.files import load_json
from engine.model import gguf_checkpoint
from engine.model.decoder import CausalLM
from engine.model.layers import weight_of

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from engine.quant.linear import Int4Linear, Int8Linear

# Mixtral checkpoints name the MoE block and its experts' matrices differently.
_RENAMES = (
    (re.compile(r"\.block_sparse_moe\."), ".mlp."),
    (re.compile(r"(\.experts\.\d+)\.w1\."), r"\1.gate_proj."),
    (re.compile(r"(\.experts\.\d+)\.w3\."), r"\1.up_proj."),
    (re.compile(r"(\.experts\.\d+)\.w2\."), r"\1.down_proj."),
)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass
class LoadedModel:
    model: CausalLM
    config: ModelConfig
    tokenizer: PreTrainedTokenizerBase | None
    source_description: str


def load_model(
    source: str,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int | None = None,
    random_weights: bool = False,
    weight_dtype: str = "auto",
    int8_kernel: str = "auto",
    lm_head_dtype: str = "auto",
) -> LoadedModel:
    """A model from a checkpoint folder, a .gguf file, a catalog name or a config.json path.

    random_weights=True skips reading weights: parameters are drawn from N(0, initializer_range)
    with a generator seeded by `seed` (0 when None), norms set to 1 and biases to 0.
    weight_dtype other than "auto" quantises the transformer layers' weights
    (engine.quant.quantize_model, with int8_kernel for "int8"); a GGUF file's Q4_0/Q4_1 matrices
    stay as stored for "int4". lm_head_dtype "int8" quantises the LM head too (quantize_lm_head).
    """
    # A GGUF file's own groups are kept where the kernel runs them (not fbgemm's per-channel W8A8).
    keep = weight_dtype if weight_dtype == "int4" or (weight_dtype == "int8" and int8_kernel != "dynamic") else None
    loaded = _load(source, dtype, device, seed, random_weights, keep)
    if weight_dtype != "auto" and getattr(loaded.model, "weight_dtype", "auto") == "auto":
        from engine.model.quantize import quantize_model

        how = ""
        calibration = _calibration_ids(loaded) if weight_dtype == "int8" and int8_kernel == "dynamic" else None
        if weight_dtype == "int8":
            how = f" (int8 kernel {int8_kernel}" + (f", SmoothQuant on {len(calibration)} tokens)" if calibration else ")")
        quantize_model(loaded.model, weight_dtype, int8_kernel=int8_kernel,  # type: ignore[arg-type]  # names checked by EngineConfig
                       calibration_ids=calibration)
        loaded.source_description += f"; transformer-layer weights quantised to {weight_dtype}{how}"
    if lm_head_dtype == "int8":
        from engine.model.quantize import quantize_lm_head

        calibration = _calibration_ids(loaded)
        kernel = quantize_lm_head(loaded.model, calibration)
        smoothed = f", SmoothQuant on {len(calibration)} tokens" if kernel == "dynamic" else ""
        loaded.source_description += f"; LM head quantised to int8 (kernel {kernel}{smoothed})"
    return loaded


def _calibration_ids(loaded: LoadedModel) -> list[int]:
    """Tokens whose activations set the W8A8 kernel's SmoothQuant factors: the fixed calibration
    text, or (a model without a tokenizer) 128 seeded random ids."""
    from engine.quant.smooth import CALIBRATION_TEXT

    if loaded.tokenizer is not None:
        return loaded.tokenizer.encode(CALIBRATION_TEXT)
    return torch.randint(0, loaded.config.vocab_size, (128,), generator=torch.Generator().manual_seed(0)).tolist()


def _load(
    source: str, dtype: torch.dtype, device: torch.device | str, seed: int | None, random_weights: bool,
    keep_groups: str | None,
) -> LoadedModel:
    path = Path(source).expanduser()
    key = source.strip().lower()
    if key in gguf_checkpoint.PACKAGED_GGUF and not path.exists() and not random_weights:
        return _load_gguf(gguf_checkpoint.packaged_gguf_path(key), key, dtype, device, seed, random_weights, keep_groups)
    if path.suffix == ".gguf":
        return _load_gguf(path, path.stem, dtype, device, seed, random_weights, keep_groups)
    if path.is_dir() and not random_weights:
        return _load_folder(path, dtype, device)
    if not path.exists() and (source.startswith((".", "~")) or "/" in source):
        raise InputError("model", source, "no such file or folder")

    config = resolve_model(source)
    if not random_weights:
        raise InputError(
            "model", source,
            "names an architecture without weights; pass random_weights=True, or a checkpoint folder or .gguf file",
        )
    model = build_model(config, dtype, device)
    init_random_weights(model, seed)
    tokenizer = _folder_tokenizer(path) if path.is_dir() else None
    return LoadedModel(model, config, tokenizer, f"{config.name or source} with random weights (seed {seed or 0})")


def build_model(config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> CausalLM:
    """A CausalLM with uninitialised parameters allocated directly on device in dtype."""
    with torch.device(device), _default_dtype(dtype):
        model = CausalLM(config)
    return model.eval().requires_grad_(False)


@torch.no_grad()
def init_random_weights(model: CausalLM, seed: int | None) -> None:
    std = float(model.config.hf_config.get("initializer_range", 0.02))
    device = weight_of(model.lm_head).device
    generator = torch.Generator(device=device).manual_seed(seed or 0)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            param.normal_(0.0, std, generator=generator)


@torch.no_grad()
def load_weights(model: CausalLM, tensors: Iterable[tuple[str, Tensor, str]], source: str) -> None:
    """Copy (HF name, tensor, file it came from) triples into the model; every parameter must be covered."""
    params = dict(model.named_parameters())
    targets = _checkpoint_targets(model)
    pending = set(targets)
    tied = model.config.tie_word_embeddings
    for raw_name, tensor, origin in tensors:
        name = _canonical_name(raw_name)
        if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
            continue  # derived from the config, or a duplicate of the embedding
        if name in targets:
            param_name, index = targets[name]
            pending.discard(name)
        elif name in params:  # already in our layout (fused experts of transformers 5, our own fused qkv)
            param_name, index = name, ()
            pending.difference_update(n for n, (p, _) in targets.items() if p == name)
        else:
            model_type = model.config.model_type
            raise InputError("checkpoint", origin, f"tensor {raw_name} has no place in a {model_type} model of this config")
        destination = params[param_name][index]
        if tuple(tensor.shape) != tuple(destination.shape):
            raise InputError(
                "checkpoint", origin,
                f"tensor {raw_name} has shape {list(tensor.shape)} but the config implies {list(destination.shape)}",
            )
        destination.copy_(tensor)
    if pending:
        missing = sorted(pending)
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise InputError("checkpoint", source, f"{len(missing)} tensor(s) missing: {', '.join(missing[:3])}{more}")


def _load_folder(folder: Path, dtype: torch.dtype, device: torch.device | str) -> LoadedModel:
    config = ModelConfig.from_json_file(folder)
    files = _safetensors_files(folder)
    model = build_model(config, dtype, device)
    load_weights(model, _read_safetensors(files), str(folder))
    size_gb = sum(f.stat().st_size for f in files) / 1e9
    description = f"safetensors checkpoint {folder} ({len(files)} file{'s' * (len(files) > 1)}, {size_gb:.2f} GB)"
    return LoadedModel(model, config, _folder_tokenizer(folder), description)


def _load_gguf(
    path: Path,
    name: str,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int | None,
    random_weights: bool,
    keep_groups: str | None,
) -> LoadedModel:
    """keep_groups ("int4" / "int8"): quantise to it, keeping the file's matrices that are already
    in a matching block format (gguf_checkpoint.gguf_quantized_groups) as they are."""
    reader = gguf_checkpoint.open_gguf(path)
    config = gguf_checkpoint.gguf_model_config(reader, path, name)
    model = build_model(config, dtype, device)
    if random_weights:
        init_random_weights(model, seed)
        description = f"{path.name} architecture with random weights (seed {seed or 0})"
    else:
        load_weights(model, gguf_checkpoint.gguf_tensors(reader, config, path), str(path))
        quants, dtype_name = gguf_checkpoint.gguf_quant_types(reader), str(dtype).removeprefix("torch.")
        description = f"GGUF {path} ({quants}; dequantised to {dtype_name})"
        if keep_groups is not None:  # rather than quantise the file's blocks a second time
            from engine.model.quantize import quantizable_linears, quantize_model

            linears = quantizable_linears(model)
            fused = _fused_rows(model, gguf_checkpoint.gguf_quantized_groups(reader, config, keep_groups))
            kept = {name: groups for name, groups in fused.items() if name in linears}
            quantize_model(model, keep_groups, checkpoint_groups=kept)  # type: ignore[arg-type]  # int4 or int8
            # quantize_model has just swapped each of them for one of these
            kernels = sorted({cast("Int4Linear | Int8Linear", model.get_submodule(name)).kernel for name in linears})
            description += (f"; {keep_groups}: {len(kept)} of {len(linears)} layer matrices keep the file's groups of "
                            f"{gguf_checkpoint.GGUF_BLOCK}, the rest quantised from the dequantised weights "
                            f"(kernel {', '.join(kernels)})")
    return LoadedModel(model, config, gguf_checkpoint.gguf_tokenizer(reader, path), description)


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        parsed = load_json(index, "checkpoint index")
        weight_map = parsed.get("weight_map") if isinstance(parsed, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise InputError("checkpoint index", str(index),
                             "is not a valid safetensors index (needs a weight_map object of tensor -> file name)")
        files = [folder / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise InputError("checkpoint shard", str(file), f"is listed in {index.name} but missing")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise InputError(
            "model", str(folder),
            "holds no *.safetensors files; pass random_weights=True to run its config.json with random weights",
        )
    return files


def _read_safetensors(files: list[Path]) -> Iterator[tuple[str, Tensor, str]]:
    from safetensors import SafetensorError, safe_open

    for file in files:
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name), str(file)
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise InputError("checkpoint file", str(file), f"cannot be read as safetensors ({exc})") from None


def _folder_tokenizer(folder: Path) -> PreTrainedTokenizerBase | None:
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except (ValueError, OSError, KeyError) as exc:
        raise InputError("tokenizer", str(folder), f"cannot be loaded ({exc})") from None


def hf_state_dict(model: CausalLM) -> dict[str, Tensor]:
    """Our parameters under their HF checkpoint names (fused projections split back): the
    inverse of loading, so a transformers model can run on exactly our weights."""
    params = dict(model.named_parameters())
    return {hf: params[ours][index] for hf, (ours, index) in _checkpoint_targets(model).items()}


def _fused_rows(model: CausalLM, parts: dict[str, tuple[Tensor, ...]]) -> dict[str, tuple[Tensor, ...]]:
    """Per-row arrays of checkpoint matrices (e.g. int4 codes, scales, zeros keyed by HF name)
    assembled like their weights into our fused modules: {module name: arrays}. A module gets
    them only when every checkpoint matrix it fuses has them (a Q4 q_proj beside a Q8 v_proj
    does not make a Q4 qkv_proj)."""
    params = dict(model.named_parameters())
    targets = _checkpoint_targets(model)
    wanted: dict[str, int] = {}
    for param_name, _ in targets.values():
        wanted[param_name] = wanted.get(param_name, 0) + 1
    fused: dict[str, list[Tensor]] = {}
    found: dict[str, int] = {}
    for name, arrays in parts.items():
        param_name, index = targets.get(_canonical_name(name), ("", ()))
        if param_name not in params or params[param_name].dim() != 2:  # only plain layer matrices
            continue
        rows = params[param_name].shape[0]
        buffers = fused.setdefault(param_name, [torch.zeros((rows, *a.shape[1:]), dtype=a.dtype) for a in arrays])
        for buffer, array in zip(buffers, arrays, strict=True):
            buffer[index] = array
        found[param_name] = found.get(param_name, 0) + 1
    return {p.removesuffix(".weight"): tuple(b) for p, b in fused.items() if found[p] == wanted[p]}


def _checkpoint_targets(model: CausalLM) -> dict[str, tuple[str, tuple[int | slice, ...]]]:
    """HF checkpoint tensor name -> (our parameter, index into it), for every tensor expected."""
    targets: dict[str, tuple[str, tuple[int | slice, ...]]] = {}
    config = model.config
    q_size, kv_size = config.num_attention_heads * config.head_dim, config.num_kv_heads * config.head_dim
    for name, param in model.named_parameters():
        module, leaf = name.rsplit(".", 1)
        prefix, last = module.rsplit(".", 1) if "." in module else ("", module)
        if last == "qkv_proj":
            sizes = {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size}
            for part, rows in _shards(sizes):
                targets[f"{prefix}.{part}.{leaf}"] = (name, (rows,))
        elif last == "gate_up_proj":
            half = param.shape[0] // 2
            for part, rows in _shards({"gate_proj": half, "up_proj": half}):
                targets[f"{prefix}.{part}.{leaf}"] = (name, (rows,))
        elif last == "experts":  # stacked [E, ...]: one checkpoint tensor per expert and matrix
            for expert in range(param.shape[0]):
                if leaf == "gate_up_proj":
                    half = param.shape[1] // 2
                    for part, rows in _shards({"gate_proj": half, "up_proj": half}):
                        targets[f"{module}.{expert}.{part}.weight"] = (name, (expert, rows))
                else:
                    targets[f"{module}.{expert}.{leaf}.weight"] = (name, (expert,))
        else:
            targets[name] = (name, ())
    return targets


def _shards(sizes: dict[str, int]) -> Iterator[tuple[str, slice]]:
    start = 0
    for part, size in sizes.items():
        yield part, slice(start, start + size)
        start += size


def _canonical_name(name: str) -> str:
    for pattern, replacement in _RENAMES:
        name = pattern.sub(replacement, name)
    return name


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
