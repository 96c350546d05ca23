"""How many CPU threads the engine should use by default: one per physical core it may run on.

More threads than cores makes every parallel torch op wait for descheduled threads; a process
sharing the machine with other work then slows down many times over. Torch's own default counts
the machine's physical cores, ignoring the CPU affinity mask and container quotas this process
actually runs under, so the count is worked out here:

1. OMP_NUM_THREADS, when set, wins: the user has already chosen.
2. Otherwise, the physical cores among the CPUs in this process's affinity mask
   (`os.sched_getaffinity`), a core being a distinct (package, core id) pair in
   /sys/devices/system/cpu/cpuN/topology, so hyper-thread siblings count once;
3. capped by a cgroup v2 CPU quota (`/sys/fs/cgroup/cpu.max`, quota / period, rounded up).

Where the topology cannot be read, every CPU of the mask counts as a core.

Measured (issue #22, docs/benchmarks.md): on an idle machine one thread per physical core is the
fastest setting; on the shared 2-core development machine, with other jobs holding the cores, 2
threads made SmolLM2's batch-1 decode ~10x slower than 1 thread (and llama.cpp's ~6x), as every
parallel op waits for a descheduled thread. There, pass --threads 1 (or OMP_NUM_THREADS=1).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

SYS_CPU = Path("/sys/devices/system/cpu")
CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def default_threads() -> int:
    """OMP_NUM_THREADS if set to a positive integer, else `physical_cores()`."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    return int(env) if env.isdigit() and int(env) > 0 else physical_cores()


def physical_cores() -> int:
    """Physical cores this process may run on (see the module docstring for how)."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        topology = SYS_CPU / f"cpu{cpu}" / "topology"
        try:
            cores.add((topology.joinpath("physical_package_id").read_text().strip(),
                       topology.joinpath("core_id").read_text().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))
    return max(1, min(len(cores), _cgroup_cpu_limit() or len(cores)))


def _cgroup_cpu_limit() -> int | None:
    try:
        quota, period = CGROUP_CPU_MAX.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else math.ceil(int(quota) / int(period))
