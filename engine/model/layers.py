"""The dense building blocks of a Llama-family decoder: linear, embedding, RMSNorm, SwiGLU MLP.

Parameters are created with torch.empty, never initialised here: the loader fills every one
from a checkpoint or from a seeded generator, so building an 8B model costs no init time.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
import torch.nn.functional as F

from engine import kernels


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)


def weight_of(module: nn.Module) -> Tensor:
    """module.weight, typed, for a module slot declared nn.Module because another module replaces
    its Linear or Embedding (a quantised Linear, a tensor-parallel shard): each keeps a weight."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, Tensor):
        raise TypeError(f"{type(module).__name__} has no weight tensor")
    return weight


def lay_out_cpu_matmul_weights(model: nn.Module, embedding: nn.Module) -> None:
    """Store every fp32 matmul weight of `model` on the CPU column-major: the same [out, in] tensor
    and values, strides (1, out). F.linear(x, W) then reaches oneDNN as x times a contiguous
    [in, out] matrix, which on the AVX-512 Xeon of docs/validation.md ran 1.4-2.5x faster at 4-64
    rows and grew smoothly with them, where the row-major weight's transposed product dipped at
    8-12 rows (bench/cpu_linear_layout.py). The `embedding` table stays row-major (a lookup reads
    rows), unless it is tied to the LM head: then it is laid out for the head, whose matmul every
    step pays (a column-major lookup costs ~10 ms per 512 tokens here, under 1 % of their prefill). bf16 stays
    row-major: there the transposed product (AMX) is the faster one. Weights already column-major
    are left alone, so calling this again changes nothing."""
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (module is embedding or not isinstance(weight, nn.Parameter) or weight.dim() != 2
                or weight.device.type != "cpu" or weight.dtype != torch.float32 or not weight.is_contiguous()):
            continue
        weight.data = weight.data.t().contiguous().t()


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))

    def forward(self, ids: Tensor) -> Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """norm(x); with a residual, (norm(x + residual), x + residual): the residual add fused in."""
        if kernels.use_triton(x):
            from engine.kernels.rmsnorm import fused_add_rms_norm, rms_norm

            return rms_norm(x, self.weight, self.eps) if residual is None else fused_add_rms_norm(
                x, residual, self.weight, self.eps)
        if residual is not None:
            x = residual = x + residual
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:  # the same math, fewer dispatches
            normed = F.rms_norm(x, self.weight.shape, self.weight, self.eps)
            return normed if residual is None else (normed, residual)
        # Normalise in fp32 so bf16 activations keep the reference's precision.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        normed = self.weight * x32.to(x.dtype)
        return normed if residual is None else (normed, residual)


def silu_and_mul(gate_up: Tensor) -> Tensor:
    """SwiGLU on a fused [.., 2 * I] projection whose first half is the gate."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size)
        self.down_proj = Linear(intermediate_size, hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))
