"""Helpers the tensor-parallel tests run in spawned processes: importable by name, as spawn needs."""

from __future__ import annotations

from multiprocessing.queues import Queue

import torch
import torch.distributed as dist

from engine.kernels.metadata import build_attention_metadata
from engine.model.attention import allocate_kv_caches
from engine.model.loader import load_model
from engine.parallel.group import TPGroup
from engine.parallel.layers import local_config, shard_model

BLOCK = 4


def logits(model_dir: str, prompt: list[int], decode: list[int], rank: int = 0, world: int = 1,
           expert_parallel: bool = False) -> torch.Tensor:
    """fp32 logits of every prompt position, then of each decode token after it, on one rank of
    `world` (the default process group must already be up when world > 1)."""
    torch.set_num_threads(1)
    loaded = load_model(model_dir, random_weights=True, seed=3)
    model, config = loaded.model, loaded.config
    if world > 1:
        shard_model(model, TPGroup(rank, world), expert_parallel)
        config = local_config(config, world)
    total = len(prompt) + len(decode)
    caches = allocate_kv_caches(config, -(-total // BLOCK), BLOCK, torch.float32, "cpu")
    table = list(range(len(caches[0][0])))
    out, seen = [], 0
    with torch.inference_mode():
        for chunk in [prompt, *([t] for t in decode)]:
            seen += len(chunk)
            positions, meta = build_attention_metadata([len(chunk)], [seen], [table], BLOCK)
            hidden = model(torch.tensor(chunk), positions, meta, caches)
            out.append(model.compute_logits(hidden))
    return torch.cat(out)


def rank_logits(rank: int, world: int, init: str, model_dir: str, prompt: list[int], decode: list[int],
                expert_parallel: bool, results: Queue) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        result = logits(model_dir, prompt, decode, rank, world, expert_parallel)
        if rank == 0:
            results.put(result.numpy())
    finally:
        dist.destroy_process_group()


def rank_all_reduce(rank: int, world: int, init: str, numels: list[int], results: Queue) -> None:
    """Each size all-reduced from rank-dependent values: (this rank's sum, the exact float64 sum)."""
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        out = []
        for n in numels:
            parts = [torch.randn(n, generator=torch.Generator().manual_seed(100 * n + r)) for r in range(world)]
            x = parts[rank].view(-1, 4).clone()  # 2-D, as the layers call it
            TPGroup(rank, world).all_reduce(x)
            out.append((x.reshape(-1).numpy(), torch.stack(parts).double().sum(0).numpy()))
        results.put((rank, out))
    finally:
        dist.destroy_process_group()
