"""Routed experts over a tensor-parallel group: split each expert's width, or place whole experts.

Width split (expert_parallel = 1): every rank keeps 1/N of each expert's gate/up rows and down
columns, runs the router on all tokens, and one all-reduce sums the partial outputs, as an MLP.

Expert parallelism (expert_parallel = N): rank r keeps experts [r E/N, (r+1) E/N) whole. The
tokens are the same on every rank after the tensor-parallel attention, so each rank routes a
contiguous 1/N of them (as Megatron-LM's sequence-parallel dispatcher does) and an all-to-all
sends each (token, chosen expert) row to the rank holding that expert; the owner runs its experts,
a second all-to-all brings the outputs back, the source weights and sums them per token, and an
all-gather puts every token's output on every rank again. Rows travel sorted by expert, so the
per-expert counts exchanged first tell the owner which of its experts each row is for.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from engine.model.moe import Experts, SparseMoE
from engine.parallel.group import TPGroup


class WidthParallelMoE(nn.Module):
    """A SparseMoE whose experts hold this rank's share of their width; outputs all-reduced."""

    def __init__(self, moe: SparseMoE, group: TPGroup) -> None:
        super().__init__()
        self.moe, self.group = moe, group

    def forward(self, x: Tensor) -> Tensor:
        return self.group.all_reduce(self.moe(x))


def shard_expert_width(moe: SparseMoE, group: TPGroup) -> WidthParallelMoE:
    experts = moe.experts
    width = experts.down_proj.shape[2]
    part = width // group.size
    cols = slice(group.rank * part, (group.rank + 1) * part)
    gate_up = experts.gate_up_proj.detach()
    experts.gate_up_proj = nn.Parameter(torch.cat([gate_up[:, cols], gate_up[:, width:][:, cols]], dim=1).clone(),
                                        requires_grad=False)
    experts.down_proj = nn.Parameter(experts.down_proj.detach()[:, :, cols].clone(), requires_grad=False)
    return WidthParallelMoE(moe, group)


class ExpertParallelMoE(nn.Module):
    def __init__(self, moe: SparseMoE, group: TPGroup) -> None:
        super().__init__()
        self.group, self.top_k, self.renormalize = group, moe.top_k, moe.renormalize
        self.gate = moe.gate  # the router is small and replicated
        num_experts = moe.experts.gate_up_proj.shape[0]
        self.num_local = num_experts // group.size
        mine = slice(group.rank * self.num_local, (group.rank + 1) * self.num_local)
        _, two_width, hidden = moe.experts.gate_up_proj.shape
        self.experts = Experts(self.num_local, hidden, two_width // 2)
        self.experts.gate_up_proj = nn.Parameter(moe.experts.gate_up_proj.detach()[mine].clone(), requires_grad=False)
        self.experts.down_proj = nn.Parameter(moe.experts.down_proj.detach()[mine].clone(), requires_grad=False)
        self.num_experts = num_experts

    def forward(self, x: Tensor) -> Tensor:
        group, k = self.group, self.top_k
        share = -(-x.shape[0] // group.size)  # tokens this rank routes; the last rank may have fewer
        mine = x[group.rank * share : (group.rank + 1) * share]
        probs = torch.softmax(self.gate(mine).float(), dim=-1)
        weights, expert_ids = torch.topk(probs, k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)

        # Dispatch: (token, expert) rows sorted by expert, hence by owning rank.
        flat_ids = expert_ids.flatten()
        order = flat_ids.argsort(stable=True)
        per_expert = torch.bincount(flat_ids, minlength=self.num_experts).view(group.size, self.num_local)
        from_each = group.exchange_counts(per_expert)  # [source rank, my expert]: rows coming here
        send = per_expert.sum(dim=1).tolist()
        recv = from_each.sum(dim=1).tolist()
        rows = group.all_to_all(mine[order // k], send, recv)

        # Rows from each source arrive sorted by local expert: run each through its expert.
        local_ids = torch.repeat_interleave(
            torch.arange(self.num_local, device=x.device).repeat(group.size), from_each.flatten())
        out = self.experts(rows, local_ids[:, None], torch.ones_like(local_ids, dtype=rows.dtype)[:, None])

        # Combine: back to the sources in the order they were sent, weighted and summed per token.
        back = group.all_to_all(out, recv, send)
        back *= weights.flatten()[order, None].to(back.dtype)
        y = torch.zeros_like(mine).index_add_(0, order // k, back)
        if y.shape[0] < share:
            y = torch.cat([y, y.new_zeros(share - y.shape[0], y.shape[1])])
        return group.all_gather(y)[: x.shape[0]]
