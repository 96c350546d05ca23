"""Routed mixture of experts (Mixtral, Qwen3-MoE): softmax router, top-k, SwiGLU experts.

Experts live in two stacked tensors, as in transformers 5 and as a grouped-GEMM kernel
wants them: gate_up_proj [E, 2 * I, H] (gate rows first) and down_proj [E, H, I].
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
import torch.nn.functional as F

from engine.model.layers import Linear, silu_and_mul


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: Tensor, expert_ids: Tensor, weights: Tensor) -> Tensor:
        """x [T, H]; expert_ids, weights [T, k] -> sum over k of weight * expert(x), [T, H].

        Torch reference: (token, expert) pairs sorted by expert, one matmul pair per expert
        that received tokens. A fused-MoE kernel replaces this on CUDA.
        """
        top_k = expert_ids.shape[1]
        flat_ids = expert_ids.flatten()
        order = flat_ids.argsort(stable=True)
        tokens = order // top_k
        counts = torch.bincount(flat_ids, minlength=self.gate_up_proj.shape[0]).tolist()
        x_sorted = x[tokens]
        y_sorted = torch.empty_like(x_sorted)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                rows = slice(start, start + count)
                hidden = silu_and_mul(F.linear(x_sorted[rows], self.gate_up_proj[expert]))
                y_sorted[rows] = F.linear(hidden, self.down_proj[expert])
                start += count
        y_sorted *= weights.flatten()[order, None].to(y_sorted.dtype)
        return torch.zeros_like(x).index_add_(0, tokens, y_sorted)


class SparseMoE(nn.Module):
    def __init__(
        self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, renormalize: bool
    ) -> None:
        super().__init__()
        self.top_k = top_k
        # Mixtral always rescales the chosen k probabilities to sum to 1; Qwen3-MoE does when
        # norm_topk_prob is set, otherwise the weights stay a slice of the full softmax.
        self.renormalize = renormalize
        self.gate = Linear(hidden_size, num_experts)  # the router
        self.experts = Experts(num_experts, hidden_size, intermediate_size)

    def forward(self, x: Tensor) -> Tensor:
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, expert_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.experts(x, expert_ids, weights)
