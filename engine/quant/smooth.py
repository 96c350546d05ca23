"""SmoothQuant (Xiao et al. 2023) for the W8A8 int8 kernel: per-input-channel smoothing factors.

A few hidden channels of an LLM carry activations tens of times larger than the rest, in every
token; quantising activations to 7-8 bits then leaves the other channels a handful of levels.
SmoothQuant divides each input channel j of a Linear by s_j = max|x_j|^a / max|W_j|^(1-a) and
multiplies the weight's column j by the same s_j: the product is unchanged, the activations
lose their outliers and the weight (quantised per output channel, offline) takes them. The
max |x_j| come from one prefill of a fixed calibration text through the float model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

import torch
from torch import Tensor, nn

from engine.kernels.metadata import AttentionMetadata, build_attention_metadata

# Prose, a question and a little code, so the statistics are not those of one register; it
# shares no text with bench/quant_quality.py's evaluation text.
CALIBRATION_TEXT = (
    "Rivers carry water from the mountains to the sea. Along the way they shape valleys, feed farms and "
    "towns, and give homes to fish, birds and insects. People have built mills, bridges and dams on them "
    "for thousands of years, and most of the world's great cities stand beside one.\n"
    "Question: what is seventeen plus twenty-five? Answer: forty-two.\n"
    "def mean(values):\n    return sum(values) / len(values)\n"
)
ALPHA = 0.5  # the paper's default: difficulty split evenly between weights and activations
_BLOCK = 16


class CalibratedModel(Protocol):
    """What activation_amax runs: engine.model.decoder.CausalLM's interface (engine.model builds on
    engine.quant, so it is not imported here)."""

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...

    def allocate_kv_caches(self, num_blocks: int, block_size: int) -> list[Tensor]: ...

    def __call__(self, input_ids: Tensor, positions: Tensor, attn_metadata: AttentionMetadata,
                 kv_caches: list[Tensor]) -> Tensor: ...

    def compute_logits(self, hidden: Tensor) -> Tensor: ...


@torch.no_grad()
def activation_amax(model: CalibratedModel, linears: dict[str, nn.Module], token_ids: list[int]) -> dict[str, Tensor]:
    """max |x_j| per input channel of each named Linear, over one prefill of token_ids."""
    amax: dict[str, Tensor] = {}

    def record(name: str) -> Callable[[nn.Module, tuple[Tensor, ...]], None]:
        def hook(_: nn.Module, args: tuple[Tensor, ...]) -> None:
            seen = args[0].reshape(-1, args[0].shape[-1]).abs().amax(dim=0).float()
            amax[name] = seen if name not in amax else torch.maximum(amax[name], seen)
        return hook

    handles = [module.register_forward_pre_hook(record(name)) for name, module in linears.items()]
    try:
        n = len(token_ids)
        device = next(model.parameters()).device
        caches = model.allocate_kv_caches(-(-n // _BLOCK), _BLOCK)
        positions, metadata = build_attention_metadata([n], [n], [list(range(-(-n // _BLOCK)))], _BLOCK, device)
        # Through the LM head too, so that it can be calibrated like the layers' Linears.
        model.compute_logits(model(torch.tensor(token_ids, device=device), positions, metadata, caches))
    finally:
        for handle in handles:
            handle.remove()
    return amax


def smoothing_factors(weight: Tensor, x_amax: Tensor, alpha: float = ALPHA) -> Tensor:
    """s_j = max|x_j|^alpha / max|W_j|^(1 - alpha) for a weight [N, K] and its input's max |x| [K]."""
    w_amax = weight.float().abs().amax(dim=0)
    tiny = torch.finfo(torch.float32).tiny
    s = x_amax.clamp(min=tiny) ** alpha / w_amax.clamp(min=tiny) ** (1 - alpha)
    # A channel that never fired (x_amax 0) or a zero weight column: leave it alone.
    return torch.where((x_amax > 0) & (w_amax > 0), s, torch.ones_like(s))
