"""Numeric format names, defined once for the engine, the planner, the CLI and the dashboard.

Two vocabularies meet here: the planner's short storage names (`bf16`, `fp8`), which describe
any deployment, and torch's names for the dtypes ServePlan's own engine computes in
(`bfloat16`). The engine's quantised formats are subsets of the short names.
"""

from __future__ import annotations

from typing import Literal, get_args

Dtype = Literal["fp32", "bf16", "fp16", "fp8", "int8", "int4", "fp4"]
"""Formats of weights, KV cache and compute in a planned deployment."""
KVDtype = Literal["fp32", "bf16", "fp16", "fp8", "int8"]
"""Formats a KV cache is stored in (no 4-bit KV caches are modelled)."""
QuantWeightDtype = Literal["int8", "int4", "fp8"]
"""Formats the engine quantises transformer-layer weights to (engine/quant/swap.py)."""
QuantKVDtype = Literal["int8", "fp8"]
"""Quantised KV-cache formats of the engine; each keeps a scale beside every vector."""
EngineDtype = Literal["float32", "bfloat16", "float16"]
"""torch dtypes the engine computes in."""

DTYPES: tuple[str, ...] = get_args(Dtype)
KV_DTYPES: tuple[str, ...] = get_args(KVDtype)
ENGINE_DTYPES: tuple[str, ...] = get_args(EngineDtype)

KV_DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}
KV_SCALED_DTYPES: tuple[str, ...] = get_args(QuantKVDtype)
SHORT_NAME: dict[str, str] = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
"""The planner's name of each engine dtype (calibration files and profiles use these)."""
ENGINE_DTYPE_OF: dict[str, str] = {short: name for name, short in SHORT_NAME.items()}
