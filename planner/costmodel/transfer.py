"""KV copies: a step's copies to and from the offload tiers, and a prompt's KV moved from a prefill
to a decode instance, priced on the hardware profile's tiers and links.

Rules (all listed by `assumptions()`):
- A block is copied by every GPU of the instance in parallel, each its own shard (its KV heads,
  its pipeline stage's layers) over its own host link, NIC or NVLink ports.
- Tier copies run in the step, before its forward pass, at the tier's achieved rates: device to
  host at host_memory.write_gb_s, back at read_gb_s; host to disk at local_disk.write_gb_s; a
  disk hit at local_disk.read_gb_s (its hop from host memory to the device pipelines behind the
  slower disk read); plus the tier's latency once per step and direction.
- Between instances, a GPU's KV goes device to device (RDMA, NVLink): the link's bandwidth x
  interconnect efficiency plus its latency, while both engines keep computing; transfers leave a
  prefill instance one after another over its link. A CPU engine moves it through shared
  memory with its own cores: a copy out on the prefill side (after its step) and a copy in on the
  decode side (in the step that admits the request), each at the link's rate, plus its latency.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from engine.core import KVTransfers
from engine.errors import InputError
from planner.specs import Deployment, HardwareProfile, KVLink, Link, MemoryTier

GB = 1e9


@dataclass(frozen=True)
class KVTransferLink:
    """How prompt KV moves between a prefill and a decode instance."""

    link: Link
    by_engine: bool  # a CPU engine's cores copy it (send and receive cost engine time); else DMA/RDMA
    efficiency: float

    @property
    def s_per_byte(self) -> float:
        return 1.0 / (self.link.bandwidth_gb_s * GB * self.efficiency)


def transfer_link(hw: HardwareProfile, dep: Deployment, efficiency: float) -> KVTransferLink:
    """The link a disaggregated replica moves prompt KV over (Disaggregation.kv_link)."""
    assert dep.disaggregation is not None
    wanted: KVLink | Literal["none"] = dep.disaggregation.kv_link  # "none": the profile lists no link at all
    links = {"scale_up": hw.scale_up, "scale_out": hw.scale_out, "pcie": hw.pcie}
    if wanted == "auto":
        if dep.peer_access and hw.scale_up is not None and dep.gpus_per_group <= hw.scale_up.domain_size:
            wanted = "scale_up"
        else:
            wanted = next((name for name in ("scale_out", "pcie", "scale_up") if links[name] is not None), "none")
    link = links.get(wanted)
    if link is None:
        raise InputError("kv_link", wanted, f"{hw.name} lists no such link; it has "
                         + (", ".join(name for name, lk in links.items() if lk is not None) or "none"))
    return KVTransferLink(link, hw.kind == "cpu", efficiency)


class KVCopyModel:
    """Seconds of the KV copies of one instance of `dep` on `hw`."""

    def __init__(self, hw: HardwareProfile, dep: Deployment, block_bytes_per_gpu: float, interconnect_efficiency: float) -> None:
        self.hw, self.block_bytes, self.block_size_tokens = hw, block_bytes_per_gpu, dep.knobs.choices.block_size_tokens
        self.host, self.disk = hw.host_memory, hw.local_disk
        self.link = transfer_link(hw, dep, interconnect_efficiency) if dep.disaggregation is not None else None

    def tier_s(self, tier: MemoryTier | None, blocks: int, write: bool) -> float:
        if not blocks:
            return 0.0
        if tier is None:
            raise InputError("hardware", self.hw.name, "has no figures for this offload tier (host_memory, local_disk)")
        return blocks * self.block_bytes / ((tier.write_gb_s if write else tier.read_gb_s) * GB) + tier.latency_us * 1e-6

    def step_s(self, transfers: KVTransfers | None) -> float:
        """The step's copies: tiers both ways, and (CPU engines) received prompt KV."""
        if transfers is None:
            return 0.0
        n = transfers.num_blocks
        seconds = (self.tier_s(self.host, n("device", "host"), write=True)
                   + self.tier_s(self.host, n("host", "device"), write=False)
                   + self.tier_s(self.disk, n("host", "disk"), write=True)
                   + self.tier_s(self.disk, n("disk", "device"), write=False))
        if transfers.external:
            seconds += self.receive_s(transfers.num_external_blocks)
        return seconds

    def send_s(self, blocks: int) -> float:
        """Engine time of the prefill instance putting a prompt's KV on its way."""
        return self._engine_copy_s(blocks)

    def receive_s(self, blocks: int) -> float:
        """Engine time of the decode instance taking it in."""
        return self._engine_copy_s(blocks)

    def wire_s(self, blocks: int) -> float:
        """Time on the link (the latency alone when the engines copy it themselves)."""
        link = self._link()
        return (0.0 if link.by_engine else blocks * self.block_bytes * link.s_per_byte) + link.link.latency_us * 1e-6

    def _engine_copy_s(self, blocks: int) -> float:
        """Without disaggregation the only external KV is calibration's synthetic context: no copy."""
        link = self.link
        return blocks * self.block_bytes * link.s_per_byte if link is not None and link.by_engine and blocks else 0.0

    def _link(self) -> KVTransferLink:
        if self.link is None:
            raise RuntimeError("a KV transfer priced for a deployment without disaggregation")
        return self.link

    def assumptions(self) -> dict[str, object]:
        def tier(t: MemoryTier | None) -> dict[str, object] | None:
            return None if t is None else t.model_dump()

        link = self.link
        return {
            "kv_block_bytes_per_gpu": self.block_bytes,
            "host_memory": tier(self.host),
            "local_disk": tier(self.disk),
            "kv_transfer_link": None if link is None else {
                **link.link.model_dump(), "efficiency": link.efficiency,
                "moved_by": "the engines' cores through shared memory" if link.by_engine else "DMA/RDMA, device to device"},
        }
