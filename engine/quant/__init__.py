"""Weight and KV-cache quantisation: reference formats (formats), quantised Linear modules
(linear), the model pass (swap.quantize_model) and the KV-cache format (kv).

Submodules are imported lazily: engine.model.attention imports engine.quant.kv, and an
eager import of linear/swap here would import engine.model back while it is half built.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "quantize_model": "swap",
    "WEIGHT_DTYPES": "swap",
    "Int8Linear": "linear",
    "Int4Linear": "linear",
    "Fp8Linear": "linear",
    "KV_CACHE_DTYPES": "kv",
    "kv_cache_torch_dtype": "kv",
    "kv_bytes_per_token_per_layer": "kv",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(f"engine.quant.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'engine.quant' has no attribute {name!r}")
