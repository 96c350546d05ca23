"""What the device offers before the model arrives, and what the runtime takes for itself.

An "80 GB" H100 is not 80 GiB to an engine: CUDA reports a total (torch.cuda.mem_get_info) below
the marketed figure, and every engine sizes its KV cache from that report. Around the model the
process also holds memory no tensor accounts for: the CUDA context, cuBLAS workspaces, kernel
modules loaded on first use, and communicator buffers when a layer spans GPUs.
"""

from __future__ import annotations

from planner.memory.parts import GIB, MIB, Part
from planner.specs import HardwareProfile

# The CUDA context of a PyTorch process with lazily loaded kernel modules (CUDA_MODULE_LOADING=LAZY,
# the default since CUDA 11.7): a few hundred MiB, depending on driver and GPU.
CUDA_CONTEXT_GIB = 0.5
# Kernel modules loaded during the first forward pass (attention, GEMM, compiled kernels): vLLM
# logs it as non-torch memory at tensor parallel 1.
MODULES_GIB = 0.15
# NCCL receive buffers per GPU once the communicator has run its first collective: per channel and
# connected peer NCCL_BUFFSIZE (4 MiB, Simple) + ~4.5 MiB (LL128) + ~0.5 MiB (LL), over ~24 channels
# for ring and tree on NVLink (~0.4 GiB), over a few channels on PCIe or the network (~0.1 GiB).
NCCL_NVLINK_GIB = 0.4
NCCL_PCIE_GIB = 0.1
# cuBLAS/cuBLASLt workspace PyTorch allocates on the first GEMM: 32 MiB on Hopper and later,
# 4 MiB (cuBLASLt) + 8 MiB (cuBLAS, ":4096:2:16:8") before.
CUBLAS_WORKSPACE_MIB = {"hopper": 32, "blackwell": 32, "grace-blackwell": 32}
CUBLAS_WORKSPACE_OLDER_MIB = 12

MODULES_SOURCE = ("estimate: vLLM logs 0.16 GiB of non-torch memory at TP 1 on an H100 "
                  "(https://github.com/vllm-project/vllm/pull/12126) and 0.20 GiB on 24 GB GPUs "
                  "(https://github.com/vllm-project/vllm/pull/14447)")
NCCL_SOURCE = ("estimate from NCCL's default buffer sizes (NCCL_BUFFSIZE 4 MiB, LL128 ~4.5 MiB, LL ~0.5 MiB per "
               "channel and peer, https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html) over ~24 "
               "NVLink channels or a few PCIe ones; NCCL >= 2.22 connects lazily, so the buffers appear during the "
               "first collective, i.e. inside an engine's profiling pass")
CONTEXT_SOURCE = ("estimate: a PyTorch CUDA context with lazy module loading holds a few hundred MiB "
                  "(https://docs.nvidia.com/cuda/cuda-c-programming-guide/#lazy-loading)")
CUBLAS_SOURCE = ("PyTorch's default cuBLAS/cuBLASLt workspace: 32 MiB on compute capability >= 9, 4 + 8 MiB "
                 "before (https://github.com/pytorch/pytorch/pull/120925, CUBLAS_WORKSPACE_CONFIG)")


def reported_total(hw: HardwareProfile) -> Part:
    if hw.memory_reported_gib is None:
        return Part("device.reported", "device memory as reported", hw.memory_gib * GIB,
                    f"{hw.memory_gib:g} GiB as marketed (no reported total known for {hw.name})",
                    f"hwprofiles/{hw.name}.yaml memory_gib")
    return Part("device.reported", "device memory as reported", hw.memory_reported_gib * GIB,
                f"{hw.memory_reported_gib:g} GiB (marketed {hw.memory_gib:g} GiB)",
                hw.provenance.get("memory_reported_gib", f"hwprofiles/{hw.name}.yaml"))


def runtime(hw: HardwareProfile, gpus: int, peer_access: bool) -> list[Part]:
    """What the process holds outside the model: the CUDA context, kernel modules, NCCL buffers when a
    replica spans GPUs (each engine's rule decides which of them it counts)."""
    return [Part("runtime.context", "CUDA context", CUDA_CONTEXT_GIB * GIB, f"{CUDA_CONTEXT_GIB} GiB per process",
                 CONTEXT_SOURCE), *_non_torch(hw, gpus, peer_access)]


def cublas_workspace(hw: HardwareProfile) -> list[Part]:
    """PyTorch's cuBLAS workspace, allocated on the first GEMM (NVIDIA GPUs; other devices' BLAS not modelled)."""
    if hw.vendor != "NVIDIA":
        return []
    mib = CUBLAS_WORKSPACE_MIB.get(hw.family, CUBLAS_WORKSPACE_OLDER_MIB)
    return [Part("activation.cublas", "cuBLAS workspace (first GEMM)", mib * MIB, f"{mib} MiB on {hw.family}",
                 CUBLAS_SOURCE)]


def _non_torch(hw: HardwareProfile, gpus: int, peer_access: bool) -> list[Part]:
    """Memory the process gains outside PyTorch's allocator during its first forward pass."""
    parts = [Part("runtime.modules", "kernel modules (non-torch)", MODULES_GIB * GIB, f"{MODULES_GIB} GiB",
                  MODULES_SOURCE)]
    if gpus > 1:
        nvlink = peer_access and hw.scale_up is not None and gpus <= hw.scale_up.domain_size
        share = NCCL_NVLINK_GIB if nvlink else NCCL_PCIE_GIB
        link = hw.scale_up.name if nvlink and hw.scale_up else "PCIe"
        parts.append(Part("runtime.nccl", "NCCL buffers (non-torch)", share * GIB,
                          f"{share} GiB per GPU, {gpus} GPUs over {link}", NCCL_SOURCE))
    return parts
