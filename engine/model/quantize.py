"""quantize_model: the model pass that quantises weights and swaps modules (gpt-fast style).

The formats and the quantised modules live in engine/quant (a layer below the model); this pass
walks a built model, so it lives here.

Every engine.model.layers.Linear inside the transformer layers (model.model.layers: qkv_proj,
o_proj, gate_up_proj, down_proj) is replaced by its quantised counterpart, its weight
quantised on the way. Left in the model dtype, on purpose:
- the embedding and lm_head (also when tied): the planner's memory model counts them
  unquantised, and the logits are the most quantisation-sensitive matmul (quantize_lm_head,
  opt-in, quantises the head to int8 for the CPU's sake);
- the MoE router (SparseMoE.gate): tiny, and routing decisions flip under weight noise
  (vLLM also keeps it unquantised);
- MoE experts: stored as stacked [E, ...] tensors (engine.model.moe.Experts), not Linear
  modules, so they stay in the model dtype. Quantising them needs a grouped quantised
  matmul, which this pass does not provide.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import get_args

import torch
from torch import Tensor, nn

from engine.dtypes import QuantWeightDtype
from engine.model.decoder import CausalLM
from engine.model.layers import Linear
from engine.model.moe import SparseMoE
from engine.quant.linear import Fp8Linear, Int4Linear, Int8Kernel, Int8Linear
from engine.quant.smooth import activation_amax, smoothing_factors

WEIGHT_DTYPES: tuple[str, ...] = get_args(QuantWeightDtype)


def quantizable_linears(model: CausalLM) -> dict[str, tuple[nn.Module, str, Linear]]:
    """{module name: (parent, attribute, Linear)} for every Linear quantize_model replaces."""
    found = {}
    for prefix, parent in model.model.layers.named_modules(prefix="model.layers"):
        for attr, child in parent.named_children():
            if type(child) is Linear and not (isinstance(parent, SparseMoE) and attr == "gate"):
                found[f"{prefix}.{attr}"] = (parent, attr, child)
    return found


@torch.no_grad()
def quantize_model(
    model: CausalLM,
    weight_dtype: QuantWeightDtype,
    group_size: int = 128,
    int8_kernel: Int8Kernel = "auto",
    checkpoint_groups: Mapping[str, tuple[Tensor, ...]] | None = None,
    calibration_ids: Sequence[int] | None = None,
) -> CausalLM:
    """Quantise the transformer layers' Linear weights in place; returns the model.

    weight_dtype: "int8" (per-channel symmetric), "int4" (group-wise asymmetric, group_size
    input columns per group) or "fp8" (e4m3, per-channel). int8_kernel picks Int8Linear's
    kernel (see its docstring). checkpoint_groups: {Linear's module name: its codes and
    per-group arrays} kept as given (a pre-quantised checkpoint's own groups: Int4Linear /
    Int8Linear.from_groups) instead of quantising that Linear's float weight. calibration_ids (int8_kernel="dynamic" only): token
    ids whose prefill sets SmoothQuant factors (engine/quant/smooth.py) for the W8A8 kernel.
    Quantising a model twice is an error.
    """
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {weight_dtype!r}")
    if getattr(model, "weight_dtype", None) not in (None, "auto"):
        raise ValueError(f"model is already quantised to {model.weight_dtype}")
    linears = quantizable_linears(model)
    x_amax: dict[str, Tensor] = {}
    if weight_dtype == "int8" and int8_kernel == "dynamic" and calibration_ids is not None:
        x_amax = activation_amax(model, {n: lin for n, (_, _, lin) in linears.items()}, list(calibration_ids))
    for name, (parent, attr, linear) in linears.items():
        kept = (checkpoint_groups or {}).get(name)
        if weight_dtype == "int8" and kept:
            q, scales = kept
            new: nn.Module = Int8Linear.from_groups(linear, q, scales)
        elif weight_dtype == "int8":
            smooth = smoothing_factors(linear.weight, x_amax[name]) if name in x_amax else None
            new = Int8Linear.from_linear(linear, int8_kernel, smooth)
        elif weight_dtype == "int4":
            if kept:
                q, scales, zeros = kept
                new = Int4Linear.from_groups(linear, q, scales, zeros)
            else:
                new = Int4Linear.from_linear(linear, group_size)
        else:
            new = Fp8Linear.from_linear(linear)
        setattr(parent, attr, new)
    model.weight_dtype = weight_dtype
    return model


@torch.no_grad()
def quantize_lm_head(model: CausalLM, calibration_ids: Sequence[int] | None = None) -> Int8Kernel:
    """Replace the LM head by a per-channel Int8Linear (a tied embedding keeps its float weight for
    lookups); returns the kernel chosen. On a CPU that is the "dynamic" W8A8 matmul: the head is a small
    model's largest matmul (SmolLM2-135M: 28 M of its 134 M weights, read for every sampled row),
    and the packed weight-only int8 kernel is slow there once a batch has more than a few rows.
    calibration_ids (W8A8 only): token ids whose prefill sets the head's SmoothQuant factors."""
    head = model.lm_head
    if type(head) is not Linear:
        raise ValueError(f"the LM head is already a {type(head).__name__}")
    kernel: Int8Kernel = "dynamic" if head.weight.device.type == "cpu" else "auto"
    smooth = None
    if kernel == "dynamic" and calibration_ids is not None:
        smooth = smoothing_factors(head.weight, activation_amax(model, {"lm_head": head}, list(calibration_ids))["lm_head"])
    model.lm_head = Int8Linear.from_linear(head, kernel, smooth)
    return kernel
