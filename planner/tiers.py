"""Where KV blocks can live besides device memory, per engine instance: the device cache of the
memory plan, then the offload tiers the knobs ask for (host memory, local disk), sized in blocks
as the engine and the simulator size them and checked against what the hardware profile lists."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from engine.config import tier_blocks
from engine.errors import InputError
from planner.memory import GIB, MemoryPlan
from planner.specs import Deployment, HardwareProfile, MemoryTier


class KVTierPlan(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    tier: str = Field(description="device, host or disk")
    medium: str = Field(description="What it is, from the hardware profile")
    gib_per_replica: float = Field(description="KV bytes it holds, all GPUs of one engine instance, GiB")
    blocks: int
    tokens: int
    capacity_gib_per_replica: float | None = Field(description="What the profile lists for the instance's GPUs")
    write_gb_s: float | None = Field(description="Device to tier, per GPU")
    read_gb_s: float | None = Field(description="Tier to device, per GPU")


def offload_blocks(hw: HardwareProfile, dep: Deployment, memory: MemoryPlan) -> tuple[int, int]:
    """Host and disk tier blocks of one engine instance, from the knobs' GiB (for all its GPUs),
    checked against what the profile lists per device."""
    knobs, gpus = dep.knobs, dep.gpus_per_replica
    block_bytes = memory.kv_bytes_per_block_per_gpu * gpus
    out = []
    for name, gib, tier, what in (("kv_offload_host_gib", knobs.kv_offload_host_gib, hw.host_memory, "host_memory"),
                                  ("kv_offload_disk_gib", knobs.kv_offload_disk_gib, hw.local_disk, "local_disk")):
        if not gib:
            out.append(0)
            continue
        if tier is None:
            raise InputError(name, gib, f"{hw.name} lists no {what} figures to price the tier with; give a profile that does")
        if gib > tier.capacity_gib * gpus:
            raise InputError(name, gib, f"exceeds the {tier.capacity_gib * gpus:,.0f} GiB {hw.name} lists for "
                             f"{gpus} GPU(s) ({tier.name})")
        blocks = tier_blocks(gib, block_bytes)
        if blocks < 1:
            raise InputError(name, gib, f"holds no KV block of {block_bytes:,} bytes")
        out.append(blocks)
    return out[0], out[1]


def kv_tiers(hw: HardwareProfile, dep: Deployment, memory: MemoryPlan) -> list[KVTierPlan]:
    """The device cache and each offload tier the deployment uses (or the profile offers, at 0 GiB)."""
    gpus, bs = dep.gpus_per_replica, memory.block_size_tokens
    block_gib = memory.kv_bytes_per_block_per_gpu * gpus / GIB
    host, disk = offload_blocks(hw, dep, memory)
    rows = [KVTierPlan(tier="device", medium=f"{hw.display_name} memory", gib_per_replica=memory.kv_cache_blocks * block_gib,
                       blocks=memory.kv_cache_blocks, tokens=memory.kv_cache_blocks * bs, capacity_gib_per_replica=None,
                       write_gb_s=None, read_gb_s=None)]

    def row(name: str, tier: MemoryTier | None, blocks: int) -> None:
        if tier is None and not blocks:
            return
        rows.append(KVTierPlan(tier=name, medium=tier.name if tier else "-", gib_per_replica=blocks * block_gib,
                               blocks=blocks, tokens=blocks * bs,
                               capacity_gib_per_replica=tier.capacity_gib * gpus if tier else None,
                               write_gb_s=tier.write_gb_s if tier else None, read_gb_s=tier.read_gb_s if tier else None))

    row("host", hw.host_memory, host)
    row("disk", hw.local_disk, disk)
    return rows
