"""Calibration: measure the local device and real engine steps, fit the cost model to them.

`serveplan calibrate` (1) detects the device, (2) runs micro-benchmarks — sustained memory
bandwidth, matmul throughput at several shapes, paged attention at several context lengths —
whose best figures become the device's hardware profile (created when absent), (3) times a
grid of real engine steps (prefill chunks over cached context, decode batches at several
context lengths, mixed batches) built as SchedulerOutputs and run by the engine's ModelRunner,
and (4) fits CostParams with SciPy least squares so that `CostModel.step_time` of each
SchedulerOutput matches its measured time. The result, with raw measurements, residuals, the
device and the date, is written under hwprofiles/calibrations/.

The grid is single steps of chosen shapes; `serveplan validate` then checks whole workloads the fit
never saw. Torch is imported inside functions only (planner/ must start without it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, fields
import datetime as dt
from functools import partial
import hashlib
import itertools
import json
import os
from pathlib import Path
import platform
import re
import statistics
import time
from multiprocessing.queues import Queue
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from scipy.optimize import isotonic_regression, least_squares
import yaml

from engine.config import EngineConfig, ModelConfig
from engine.dtypes import SHORT_NAME
from engine.core import Request, SamplingParams, SchedulerOutput
from engine.core.metrics import StepSample
from engine.errors import EXCERPT_CHARS, InputError, from_validation_error
from engine.files import load_json, output_file
from hwprofiles import PROFILE_DIR
from planner.costmodel import CostModel, CostParams
from planner.hardware import hardware_catalog
from planner.specs import MAX_GEMM_HALF_SIZE_TOKENS, Collective, CollectiveCurve, Deployment, EngineKnobs, HardwareProfile, Link

if TYPE_CHECKING:
    from engine.llm import LLM

CALIBRATION_DIR = PROFILE_DIR / "calibrations"
GIB = 2**30
COMM_RANKS = 2  # the tensor-parallel size the CPU validation runs


# --------------------------------------------------------------------------- records


class _Rec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DeviceInfo(_Rec):
    kind: Literal["cpu", "cuda"]
    name: str = Field(description="CPU model name or GPU name")
    slug: str = Field(description="Hardware profile name derived from the device")
    threads: int = Field(description="Torch intra-op threads (CPU) or streaming multiprocessors (GPU)")
    memory_gib: float
    torch_version: str


class CopyRate(_Rec):
    """time = latency + bytes / rate, fitted through two sizes of the same copy."""

    gb_s: float
    latency_us: float


class KVCopyBenchmarks(_Rec):
    """The engine's own KV block copies on its cache layout, as offload tiers and the disaggregated
    transport make them (each timed as a batch of 8 and of 64 blocks, every layer)."""

    block_bytes: int = Field(description="One block, every layer")
    host_write: CopyRate = Field(description="Device cache -> host tier (TierStore)")
    host_read: CopyRate = Field(description="Host tier -> device cache")
    disk_write: CopyRate = Field(description="Host tier -> disk tier (a memory-mapped file; here in the page cache)")
    disk_read: CopyRate = Field(description="Disk tier -> device cache")
    transport_send: CopyRate = Field(description="Device cache -> shared-memory staging (a prefill worker's send)")
    transport_receive: CopyRate = Field(description="Staging -> device cache (a decode worker's load)")
    ipc_latency_us: float = Field(description="One message between two processes through a multiprocessing queue")


class MicroBenchmarks(_Rec):
    memory_bandwidth_gb_s: float = Field(description="Best sustained copy bandwidth (read + write bytes / time)")
    matmul_tflops: dict[str, float] = Field(description="'dtype MxKxN' -> achieved TFLOPS")
    attention_kv_gb_s: dict[str, float] = Field(description="'decode batch B ctx C' -> KV bytes read / time")
    collectives_us: dict[Collective, list[tuple[int, float]]] = Field(
        default_factory=dict, description="CPU: the engine's collectives between COMM_RANKS processes over gloo, "
        "collective -> [(payload bytes, mean microseconds a call)] (engine/parallel/commbench.py)")
    kv_copies: KVCopyBenchmarks | None = Field(None, description="KV block copies (absent in calibrations made before them)")


class StepMeasurement(_Rec):
    label: str
    requests: list[tuple[int, int, bool]] = Field(description="(query tokens, cached tokens, is_prefill) per request")
    measured_s: float = Field(description="Median of the repeats")
    repeats_s: list[float]
    predicted_s: float = Field(0.0, description="The fitted cost model's prediction")
    tensor_parallel: int = Field(1, description="Engine processes the step ran on (engine/parallel)")
    expert_parallel: int = Field(1, description="Ranks its experts were placed on")
    comm_s: float | None = Field(None, description="Of measured_s, rank 0's time inside collectives (waiting for "
                                 "the other ranks included), median of the repeats; None on one process")
    comm_repeats_s: list[float] = Field(default_factory=list, description="Rank 0's time inside collectives, per repeat")


class Calibration(_Rec):
    """A fitted cost model for one (device, model, dtype); what `--calibration FILE` loads."""

    format_version: int = 1
    created_utc: str
    device: DeviceInfo
    hardware_profile: str
    profile: HardwareProfile = Field(description="The measured profile (written to hwprofiles/ only when asked)")
    model: str
    model_fingerprint: str = Field(description="SHA-256 of the model's architecture (config), to refuse a mismatch")
    dtype: str
    block_size_tokens: int
    microbenchmarks: MicroBenchmarks
    steps: list[StepMeasurement]
    params: dict[str, float | str] = Field(description="Fitted CostParams")
    fit_median_abs_error_pct: float
    fit_max_abs_error_pct: float
    notes: list[str]

    def cost_params(self) -> CostParams:
        return CostParams(**self.params)  # type: ignore[arg-type]

    @field_validator("params")
    @classmethod
    def _usable_params(cls, params: dict[str, float | str]) -> dict[str, float | str]:
        """Checked as the file is read, not once the engine has run with it: every name a cost
        parameter, every value of its type and within its range."""
        known = {f.name for f in fields(CostParams)}
        for name in params:
            if name not in known:
                raise ValueError(f"{name[:EXCERPT_CHARS]!r} is not a cost parameter; known: {', '.join(sorted(known))}")
        try:
            CostParams(**params)  # type: ignore[arg-type]
        except InputError as exc:
            raise ValueError(exc.message()) from None
        except TypeError:  # a text where a number belongs: CostParams' range checks compare it
            raise ValueError("every parameter but attention_pairs must be a number") from None
        return params


# What decides the FLOPs and bytes of a step; numerics (norm eps, RoPE base, dtype tags, token
# ids) do not, and differ harmlessly between a checkpoint's metadata and its config.json.
_SHAPE_FIELDS = ("model_type", "num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "head_dim",
                 "intermediate_size", "vocab_size", "tie_word_embeddings", "attention_bias", "qk_norm",
                 "norms_per_layer", "layer_windows", "layer_is_moe", "moe", "mla")


def model_fingerprint(model: ModelConfig) -> str:
    arch = {name: getattr(model, name) for name in _SHAPE_FIELDS}
    return hashlib.sha256(json.dumps(arch, sort_keys=True, default=str).encode()).hexdigest()[:16]


def load_calibration(path: str | Path, model: ModelConfig | None = None, hardware: str | None = None,
                     force: bool = False) -> Calibration:
    """Read a calibration; refuse one made for another model or device unless `force` (then warn)."""
    path = Path(path)
    try:
        cal = Calibration.model_validate(load_json(path, "calibration"))
    except ValidationError as exc:
        problem = from_validation_error(exc)
        raise InputError("calibration", str(path), f"not a valid calibration file ({problem.field}: {problem.allowed})") from None
    problems = []
    if model is not None and cal.model_fingerprint != model_fingerprint(model):
        problems.append(f"it was made for model {cal.model!r}, not {model.name!r}")
    if hardware is not None and cal.hardware_profile != hardware:
        problems.append(f"it was made on {cal.hardware_profile!r}, not {hardware!r}")
    if problems:
        if not force:
            raise InputError("calibration", str(path), "; ".join(problems) + " (use --force to apply it anyway)")
        import warnings

        warnings.warn(f"calibration {path}: " + "; ".join(problems), stacklevel=2)
    return cal


# --------------------------------------------------------------------------- device


def detect_device(device: str = "auto") -> DeviceInfo:
    import torch

    if device not in ("auto", "cpu") and not re.fullmatch(r"cuda(:\d+)?", device):
        raise InputError("device", device, "allowed: auto, cpu, cuda, cuda:N")
    use_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if use_cuda:
        if not torch.cuda.is_available():
            raise InputError("device", device, "no CUDA device is visible to torch")
        props = torch.cuda.get_device_properties(torch.device(device if device != "auto" else "cuda"))
        return DeviceInfo(kind="cuda", name=props.name, slug=_slug("gpu-" + props.name), threads=props.multi_processor_count,
                          memory_gib=props.total_memory / GIB, torch_version=torch.__version__)
    name = _cpu_name()
    threads = torch.get_num_threads()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    return DeviceInfo(kind="cpu", name=name, slug=_slug(f"cpu-{name}-{threads}t"), threads=threads,
                      memory_gib=memory, torch_version=torch.__version__)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-")


# --------------------------------------------------------------------------- micro-benchmarks


def _median_time(fn: Callable[[], object], repeats: int, sync: Callable[[], None]) -> float:
    fn()  # warm-up: allocation, caches, lazy initialisation
    sync()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def micro_benchmarks(device_kind: str, dtype: str, quick: bool) -> MicroBenchmarks:
    import torch

    from engine.kernels.metadata import build_attention_metadata
    from engine.model.attention import allocate_kv_cache, paged_attention

    dev = torch.device("cuda" if device_kind == "cuda" else "cpu")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    tdtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    reps = 3 if quick else 5

    n = (1 << 28 if dev.type == "cuda" else 1 << 26) // (2 if quick else 1)  # 0.5 or 1 GiB fp32 on a GPU, 128-256 MiB on CPU
    src, dst = torch.ones(n, device=dev), torch.empty(n, device=dev)
    bandwidth = 2 * n * 4 / _median_time(lambda: dst.copy_(src), reps, sync) / 1e9
    del src, dst

    matmul: dict[str, float] = {}
    shapes = [(1, 2048, 2048), (16, 2048, 2048), (256, 2048, 2048), (1024, 1024, 1024)]
    if dev.type == "cuda":
        shapes += [(4096, 4096, 4096)]
    for m, k, nn in shapes:
        a, b = torch.randn(m, k, device=dev, dtype=tdtype), torch.randn(k, nn, device=dev, dtype=tdtype)
        seconds = _median_time(lambda: a @ b, reps, sync)  # timed at once: the loop's values need no binding
        matmul[f"{dtype} {m}x{k}x{nn}"] = 2 * m * k * nn / seconds / 1e12

    attention: dict[str, float] = {}
    heads, kv_heads, head_dim, block = 8, 2, 64, 16
    for batch, ctx in ((4, 256), (4, 2048)) if quick else ((4, 256), (4, 1024), (4, 4096)):
        blocks_per_seq = -(-ctx // block)
        cache = allocate_kv_cache(batch * blocks_per_seq, block, kv_heads, head_dim, tdtype, dev)
        tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(batch)]
        _, meta = build_attention_metadata([1] * batch, [ctx] * batch, tables, block, dev)
        q = torch.randn(batch, heads, head_dim, device=dev, dtype=tdtype)
        seconds = _median_time(lambda: paged_attention(q, cache, meta, 0.125, None), reps, sync)  # timed at once
        kv_bytes = batch * ctx * 2 * kv_heads * head_dim * cache.element_size()
        attention[f"decode batch {batch} ctx {ctx}"] = kv_bytes / seconds / 1e9
    collectives: dict[Collective, list[tuple[int, float]]] = {}
    if dev.type == "cpu":
        from engine.parallel.commbench import measure

        collectives = measure(world=COMM_RANKS, repeats=10 if quick else 30, threads=torch.get_num_threads())  # type: ignore[assignment]
    return MicroBenchmarks(memory_bandwidth_gb_s=bandwidth, matmul_tflops=matmul, attention_kv_gb_s=attention,
                           collectives_us=collectives)


def gloo_link(micro: MicroBenchmarks, cpus: int) -> Link | None:
    """This machine's processes as a scale-up link, priced by the measured curves. A larger message
    never takes less time than a smaller one, so each curve is made non-decreasing by isotonic
    regression (violating neighbours pooled to their mean): the small messages' means are noisy
    (a rank woken late now and then), and keeping the least time at each size or above instead
    biased them low by a third."""
    if not micro.collectives_us:
        return None
    curves = {}
    for kind, points in micro.collectives_us.items():
        times = isotonic_regression([t for _, t in points]).x
        curves[kind] = CollectiveCurve(ranks=COMM_RANKS, points=tuple((size, float(t)) for (size, _), t in zip(points, times)),
                                       source=f"gloo between {COMM_RANKS} processes, measured by serveplan calibrate "
                                       "(engine/parallel/commbench.py)")
    reduce = curves["all_reduce"].points
    (small, small_us), (large, large_us) = reduce[0], reduce[-1]
    return Link(name="gloo between processes of this machine (TCP loopback)", domain_size=cpus,
                bandwidth_gb_s=max(0.1, round(large / large_us * 1e-3, 3)), latency_us=round(small_us / 2, 1),
                collectives=curves)


KV_COPY_SMALL_BLOCKS = 8
KV_COPY_LARGE_BYTES = 32 * 2**20  # the large batch: enough bytes that the per-call cost is a small share


def kv_copy_block_counts(block_bytes: int) -> tuple[int, int]:
    """The two batch sizes the copy benchmarks time: latency from the small, rate from the difference."""
    return KV_COPY_SMALL_BLOCKS, max(8 * KV_COPY_SMALL_BLOCKS, -(-KV_COPY_LARGE_BYTES // block_bytes))


def kv_copy_benchmarks(llm: LLM, reps: int) -> KVCopyBenchmarks:
    """Time the copies an offload tier and the shared-memory transport make, on `llm`'s caches
    (which need kv_copy_block_counts()[1] blocks), through the engine's own code."""
    import tempfile

    import torch

    from engine.disagg.transport import (
        SharedMemoryReceiver, SharedMemorySender, SharedMemoryStaging, StagingLayout, TransferHandle,
    )
    from engine.kv_offload import TierStore, copy_blocks

    if llm.runner is None:
        raise ValueError("kv_copy_benchmarks needs a single-process LLM: a tensor-parallel one keeps its KV caches "
                         "in its worker processes")
    caches = llm.runner.kv_caches
    sync = torch.cuda.synchronize if caches[0].device.type == "cuda" else (lambda: None)
    block_bytes = llm.kv_bytes_per_block(caches[0].dtype)
    counts = kv_copy_block_counts(block_bytes)
    slots = counts[1]
    with tempfile.TemporaryDirectory(prefix="serveplan-calibrate-") as folder:
        tiers = TierStore(caches, slots, slots, folder)
        layout = StagingLayout(len(caches), (2, *caches[0].shape[2:]), caches[0].dtype, slots)
        shm = SharedMemoryStaging.create(layout)
        try:
            staging = SharedMemoryStaging(shm.name, layout)
            sender, receiver = SharedMemorySender(0, staging), SharedMemoryReceiver([staging])

            def send(n: int) -> None:
                handle = sender.send([c[:, :n] for c in caches])
                assert handle is not None
                sender.release(handle)

            def receive(n: int) -> None:
                blocks = receiver.read(TransferHandle(0, 0, n, 0), 0, n)
                index = torch.arange(n, device=caches[0].device)
                for cache, layer in zip(caches, blocks, strict=True):
                    cache.index_copy_(1, index, layer.to(cache.device))

            def tier(src: str, dst: str) -> Callable[[int], None]:
                return lambda n: copy_blocks(tiers.places[src], range(n), tiers.places[dst], range(n))

            ops = {"host_write": tier("device", "host"), "host_read": tier("host", "device"),
                   "disk_write": tier("host", "disk"), "disk_read": tier("disk", "device"),
                   "transport_send": send, "transport_receive": receive}
            rates = {name: _copy_rate(op, counts, block_bytes, reps, sync) for name, op in ops.items()}
            staging.close()
        finally:
            shm.close()
            shm.unlink()
    return KVCopyBenchmarks(block_bytes=block_bytes, ipc_latency_us=ipc_latency_s(reps) * 1e6, **rates)


def _copy_rate(op: Callable[[int], None], counts: tuple[int, int], block_bytes: int, reps: int,
               sync: Callable[[], None]) -> CopyRate:
    """time = latency + blocks x block_bytes / rate through the two batch sizes. The large batch is
    big enough that a fixed cost should be a small share of it: when the fit puts more than half of
    it in the latency (noise in a short measurement), the large batch's own rate, with no latency."""
    small, large = (_median_time(partial(op, n), reps, sync) for n in counts)
    per_block = (large - small) / (counts[1] - counts[0])
    if per_block <= 0 or per_block < large / counts[1] / 2:
        per_block = large / counts[1]
    return CopyRate(gb_s=block_bytes / per_block / 1e9, latency_us=max(0.0, small - counts[0] * per_block) * 1e6)


def _echo(inbox: Queue[Any], outbox: Queue[Any]) -> None:
    """A child process that sends back what it gets, until None."""
    while (message := inbox.get()) is not None:
        outbox.put(message)


def ipc_latency_s(reps: int) -> float:
    """Half the median round trip of a small message to another process and back (spawned, as the
    disaggregated engine's workers are)."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    inbox, outbox = context.Queue(), context.Queue()
    child = context.Process(target=_echo, args=(inbox, outbox), daemon=True)
    child.start()
    try:
        times = []
        for i in range(10 * reps + 1):
            start = time.perf_counter()
            inbox.put(("ping", i))
            outbox.get(timeout=60)
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:]) / 2  # the first round trip waits for the child to start
    finally:
        inbox.put(None)
        child.join(timeout=10)


def local_profile(device: DeviceInfo, micro: MicroBenchmarks, dtype: str) -> HardwareProfile:
    """The device as a HardwareProfile whose peaks are the best micro-benchmark figures, so the
    fitted efficiencies read as shares of what this machine demonstrably reaches. Its KV tiers and
    its link between engine processes (shared memory) are the measured copy rates, used as they are."""
    peak_tflops = max(micro.matmul_tflops.values())
    return HardwareProfile(
        name=device.slug,
        display_name=f"{device.name} ({device.threads} threads)" if device.kind == "cpu" else device.name,
        vendor=device.name.split()[0],
        kind="cpu" if device.kind == "cpu" else "gpu",
        family=f"local-{device.kind}",
        memory_gib=round(device.memory_gib, 2),
        memory_bandwidth_gb_s=round(micro.memory_bandwidth_gb_s, 2),
        peak_tflops={dtype: round(peak_tflops, 4)},
        **_copy_figures(device, micro.kv_copies),
        provenance={
            "memory_bandwidth_gb_s": "measured: best sustained copy by serveplan calibrate",

            f"peak_tflops.{dtype}": "measured: best matmul by serveplan calibrate (not a datasheet peak)",
            "memory_gib": "physical memory of the machine",
            **({} if micro.kv_copies is None else {
                "host_memory": "measured: the engine's block copies cache <-> host tier (latency + bytes / rate, 8 and 64 blocks)",
                "local_disk": "measured: host tier -> disk tier and disk tier -> cache through a memory-mapped file, which "
                              "sits in the page cache here; capacity: half the free space where calibrate ran",
                "efficiency.interconnect": "1.0: the link and tier rates are measured achieved rates"}),
            **({"scale_up": _LINK_PROVENANCE[(micro.kv_copies is not None, bool(micro.collectives_us))]}
               if micro.kv_copies is not None or micro.collectives_us else {}),
        },
        sources=[f"measured by `serveplan calibrate` on {dt.date.today().isoformat()} (torch {device.torch_version})"],
        scale_up=local_link(micro, os.cpu_count() or 1),
    )


_LINK_PROVENANCE = {  # (KV transport measured, collectives measured)
    (True, True): "measured: bandwidth_gb_s and latency_us are the disaggregated transport's shared-memory staging "
                  "copies (mean of send and receive) and one message between processes; collectives: gloo curves",
    (True, False): "measured: shared-memory staging copies of the disaggregated transport (mean of send and receive "
                   "rates) and one message between processes",
    (False, True): "measured: the engine's collectives over gloo by serveplan calibrate; bandwidth_gb_s is the "
                   "all-reduce's at the largest message, latency_us half its time at the smallest",
}


def local_link(micro: MicroBenchmarks, cpus: int) -> Link | None:
    """This machine's engine processes as one scale-up link: point to point (a disaggregated
    prompt's KV) at the transport's measured rate, collectives on their measured gloo curves."""
    gloo, copies = gloo_link(micro, cpus), micro.kv_copies
    if copies is None:
        return gloo
    return Link(name="shared memory between engine processes" + (" (collectives over gloo)" if gloo else ""),
                domain_size=cpus, bandwidth_gb_s=(copies.transport_send.gb_s + copies.transport_receive.gb_s) / 2,
                latency_us=copies.ipc_latency_us, collectives=gloo.collectives if gloo is not None else {})


def _copy_figures(device: DeviceInfo, copies: KVCopyBenchmarks | None) -> dict[str, object]:
    """The profile's KV tiers from the KV copy benchmarks (none without them)."""
    if copies is None:
        return {}
    import shutil
    import tempfile

    free_gib = shutil.disk_usage(tempfile.gettempdir()).free / GIB
    return {
        "host_memory": {"name": "this machine's memory (host KV tier)", "capacity_gib": round(device.memory_gib / 2, 2),
                        "write_gb_s": copies.host_write.gb_s, "read_gb_s": copies.host_read.gb_s,
                        "latency_us": (copies.host_write.latency_us + copies.host_read.latency_us) / 2},
        "local_disk": {"name": "a memory-mapped file (disk KV tier; page cache)", "capacity_gib": round(max(free_gib / 2, 0.25), 2),
                       "write_gb_s": copies.disk_write.gb_s, "read_gb_s": copies.disk_read.gb_s,
                       "latency_us": (copies.disk_write.latency_us + copies.disk_read.latency_us) / 2},
        "efficiency": {"interconnect": 1.0},
    }


# --------------------------------------------------------------------------- engine step grid


def step_grid(quick: bool, max_context: int) -> list[tuple[str, list[tuple[int, int, bool]]]]:
    """(label, requests) for single engine steps: (query tokens, cached tokens, is_prefill)."""
    contexts = [c for c in ((64, 1024) if quick else (64, 512, 1536)) if c < max_context]
    grid: list[tuple[str, list[tuple[int, int, bool]]]] = []
    for batch in (1, 4, 16) if quick else (1, 2, 4, 8, 16, 32):
        for ctx in contexts:
            grid.append((f"decode b{batch} ctx{ctx}", [(1, ctx - 1, False)] * batch))
    for tokens in (16, 128, 512) if quick else (16, 64, 256, 512, 1024):
        for cached in (0, 512) if quick else (0, 1024):
            if tokens + cached < max_context:
                grid.append((f"prefill {tokens} cached {cached}", [(tokens, cached, True)]))
    for chunk, decodes in ((64, 4), (256, 8)) if quick else ((64, 4), (256, 8), (512, 16)):
        grid.append((f"mixed prefill {chunk} + {decodes} decodes",
                     [(chunk, 0, True)] + [(1, 255, False)] * decodes))
    return grid


def grid_blocks_needed(grid: list[tuple[str, list[tuple[int, int, bool]]]], block_size: int, repeats: int) -> int:
    """KV blocks for the largest grid step, with room for its decodes' repeats."""
    return max(sum(-(-(q + c + repeats + 1) // block_size) for q, c, _ in reqs) for _, reqs in grid)


def measure_steps(llm: LLM, grid: list[tuple[str, list[tuple[int, int, bool]]]], repeats: int,
                  progress: Callable[[], None] = lambda: None) -> list[StepMeasurement]:
    """Time each grid step as the engine's own step loop runs it (schedule, tensor building,
    forward pass, sampling), with real requests the scheduler admits and batches.

    The cached context of a grid step is external KV (`Request.num_external_computed_tokens`):
    the scheduler allocates its blocks without computing it, and the step's timing does not depend
    on what those blocks hold, so a decode at 1,536 tokens of context costs one decode, not a
    1,536-token prefill first. The engine must run without prefix caching (garbage KV must never
    be hit)."""
    loop, scheduler = llm.loop, llm.scheduler
    if scheduler.config.enable_prefix_caching:
        raise ValueError("measure_steps needs an engine with enable_prefix_caching=False")
    ids = itertools.count()
    timed: list[tuple[SchedulerOutput, float, float | None]] = []
    comm_stats = getattr(llm.executor, "comm_stats", None)  # a parallel engine's ranks time their collectives

    def on_step(output: SchedulerOutput, sample: StepSample) -> None:
        # Taken after the step's clock stopped; the ranks' counters restart at each take.
        comm = sum(comm_stats()[0][0].values()) if comm_stats is not None else None
        timed.append((output, sample.end_s - sample.start_s, comm))

    loop.on_step = on_step

    added: list[str] = []

    def add(prompt_len: int, external: int, max_tokens: int) -> None:
        # Each request's tokens shifted by its number: a batch of decodes then computes distinct
        # tokens, which a mixture of experts routes apart as it routes real text. Identical prompts
        # could decode identical tokens (over identical cached garbage), all sent to the same few
        # experts: a batch of 16 took 48 ms so against 72 ms distinct on qwen3-moe-85m.
        n = next(ids)
        added.append(f"cal-{n}")
        scheduler.add_request(Request(added[-1], [1 + (j + n) % 50 for j in range(prompt_len)],
                                      SamplingParams(max_tokens=max_tokens, ignore_eos=True), llm.now(),
                                      num_external_computed_tokens=external))

    out = []
    try:
        for label, shapes in grid:
            # A decode over `cached` tokens: its prompt is all but one token external, and the step
            # that computes that last token samples its first output; the decodes follow.
            for _, cached, _ in (s for s in shapes if not s[2]):
                add(cached, cached - 1, repeats + 2)
            if any(not prefill for _, _, prefill in shapes):
                loop.step()
            timed.clear()
            for _ in range(repeats + 1):  # the first run warms up
                for q, cached, _ in (s for s in shapes if s[2]):
                    add(cached + q, cached, 1)
                loop.step()
            loop.run_until_idle()
            while added:  # the engine as it was found: no finished grid request kept (their ids recur)
                scheduler.pop_finished(added.pop())
            for repeat, (output, _, _) in enumerate(timed):
                _check_shapes(label, [(q, c + (0 if prefill else repeat), prefill) for q, c, prefill in shapes], output)
            out.append(_measurement(label, _shapes(timed[1][0]), [t for _, t, _ in timed[1:]],
                                    [c for _, _, c in timed[1:] if c is not None]))
            progress()
    finally:
        loop.on_step = None
    return out


def measure_interleaved(llms: Sequence[LLM], grid: list[tuple[str, list[tuple[int, int, bool]]]], repeats: int,
                        passes: int, progress: Callable[[], None] = lambda: None) -> list[list[StepMeasurement]]:
    """`measure_steps` on each engine, its `repeats` spread over `passes` passes over the grid, each
    grid step timed on every engine in turn: one list of measurements per engine.

    A shared machine's speed drifts over minutes (a memory-bound loop has run 84 and 124 calls/s
    on this VM on successive days, and a grid step's repeats have moved 60 -> 84 ms as they ran).
    Timed back to back, a step's repeats all land in one stretch of it, and the fit reads a slow
    stretch as a slow shape; interleaved, every step and every engine sees the same mix."""
    per_pass = -(-repeats // passes)
    runs: list[list[list[StepMeasurement]]] = [[[] for _ in grid] for _ in llms]
    for _ in range(passes):
        for i, step in enumerate(grid):
            for engine_runs, llm in zip(runs, llms, strict=True):
                engine_runs[i] += measure_steps(llm, [step], per_pass)
            progress()
    return [[_measurement(parts[0].label, parts[0].requests, [t for p in parts for t in p.repeats_s],
                          [c for p in parts for c in p.comm_repeats_s]) for parts in engine_runs] for engine_runs in runs]


def _measurement(label: str, requests: list[tuple[int, int, bool]], times_s: list[float],
                 comms_s: list[float]) -> StepMeasurement:
    return StepMeasurement(label=label, requests=requests, measured_s=statistics.median(times_s), repeats_s=times_s,
                           comm_s=statistics.median(comms_s) if comms_s else None, comm_repeats_s=comms_s)


def _shapes(output: SchedulerOutput) -> list[tuple[int, int, bool]]:
    return [(s.num_tokens, s.num_computed_tokens, s.is_prefill) for s in output.scheduled]


def _check_shapes(label: str, wanted: list[tuple[int, int, bool]], output: SchedulerOutput) -> None:
    """The scheduler batched the grid step as asked: a measurement of another shape would fit the
    cost model to the wrong step."""
    got = _shapes(output)
    if sorted(got) != sorted(wanted):
        raise RuntimeError(f"calibration step {label!r}: the scheduler ran {got[:4]}, not the grid's {wanted[:4]}")


# --------------------------------------------------------------------------- fit

# The engine profile a calibration's steps are priced with: ServePlan's own engine, which it times
# and `serveplan validate` checks. Fit and validation must price the same engine (an expert-parallel
# step dispatches by all-to-all here, by all-reduce in vLLM's profile).
OWN_ENGINE_PROFILE = "serveplan"

# name: (start, lower, upper)
_FITTED: dict[str, tuple[float, float, float]] = {
    "compute_efficiency": (0.5, 0.01, 1.0), "memory_efficiency": (0.5, 0.01, 1.0),
    "attention_memory_efficiency": (0.2, 0.005, 1.0), "attention_compute_efficiency": (0.3, 0.005, 1.0),
    "step_overhead_s": (0.002, 0.0, 0.5), "layer_overhead_s": (0.0005, 0.0, 0.05),
    "gemm_half_size_tokens": (16.0, 0.0, MAX_GEMM_HALF_SIZE_TOKENS), "gemm_efficiency_floor": (0.3, 0.0, 1.0),
}
# Fitted too when the grid was also run on several engine processes: how the engine's collectives,
# between computations and on ranks that wake at their own pace, compare with the benchmark's
# (measured instead where the steps carry rank 0's time in collectives, as `calibrate` records it);
# and how much slower each rank computes beside the others on this host's shared cores and memory.
_FITTED_PARALLEL: dict[str, tuple[float, float, float]] = {"collective_time_scale": (1.0, 0.1, 10.0),
                                                           "shared_host_slowdown": (1.0, 0.5, 4.0)}


def fit_cost_params(model: ModelConfig, hw: HardwareProfile, dep: Deployment,
                    steps: list[StepMeasurement]) -> tuple[CostParams, list[float]]:
    """Least squares on relative error (every step counts alike, short or long); returns the
    parameters and each step's prediction. Each step is priced on the deployment it ran on (`dep`
    at the step's tensor and expert parallelism): steps of one process and of several share every
    figure, so the split between fixed per-layer costs (which more ranks do not shrink) and work
    (which they divide) is measured rather than assumed."""
    measured = np.array([s.measured_s for s in steps])
    base = CostParams.defaults(hw).with_values({"attention_pairs": "dense"})
    deployments = {(s.tensor_parallel, s.expert_parallel) for s in steps}
    deps = {(tp, ep): dep.model_copy(update={"tensor_parallel": tp, "expert_parallel": ep}) for tp, ep in deployments}
    parallel = [s for s in steps if s.tensor_parallel > 1]
    fitted = {**_FITTED, **(_FITTED_PARALLEL if parallel else {})}
    measured_comm_s = [s.comm_s for s in parallel if s.comm_s is not None]
    if parallel and len(measured_comm_s) == len(parallel):
        # Measured, not fitted: from step totals alone the collectives and the ranks' slowdown
        # trade off (waiting for a slower rank grows with the computation), and the fit split them
        # 2-3x away from the communication share the ranks timed.
        unit = base.with_values({"collective_time_scale": 1.0})
        ratios = [comm_s / priced for s, comm_s in zip(parallel, measured_comm_s, strict=True)
                  if (priced := CostModel(model, hw, deps[(s.tensor_parallel, s.expert_parallel)], unit)
                      .shape_cost(s.requests).comm_seconds) > 0]
        base = base.with_values({"collective_time_scale": float(np.median(ratios))})
        del fitted["collective_time_scale"]
    names = list(fitted)
    x0, lower, upper = (np.array(column) for column in zip(*fitted.values(), strict=True))

    def predict(x: np.ndarray) -> np.ndarray:
        params = base.with_values(dict(zip(names, map(float, x))))
        models = {key: CostModel(model, hw, d, params) for key, d in deps.items()}
        return np.array([models[(s.tensor_parallel, s.expert_parallel)].shape_cost(s.requests).seconds for s in steps])

    result = least_squares(lambda x: predict(x) / measured - 1.0, x0, bounds=(lower, upper), x_scale="jac")
    return base.with_values(dict(zip(names, map(float, result.x)))), predict(result.x).tolist()


# --------------------------------------------------------------------------- the command


def calibrate(model_name: str, *, device: str = "auto", dtype: str = "float32", quick: bool = False,
              out: str | Path | None = None, random_weights: bool = False, threads: int | None = None,
              write_profile: bool = False, progress: bool = True, tensor_parallel: int = 1,
              expert_parallel: int = 1) -> tuple[Calibration, Path]:
    """Measure this device and engine steps of `model_name`, fit the cost model, write the
    calibration to `out` (default under hwprofiles/calibrations/) and, with `write_profile`, the
    measured profile to hwprofiles/ when none of that name exists. With `tensor_parallel` or
    `expert_parallel` above 1, the grid is also run on that many engine processes and the fit covers
    both (what `serveplan validate --tp/--ep` should be given). Every input and the output path
    are checked, and the model loaded, before anything is measured."""
    import torch
    from rich.console import Console
    from rich.progress import Progress

    from engine.llm import LLM

    if dtype not in SHORT_NAME:
        raise InputError("dtype", dtype, f"allowed: {', '.join(SHORT_NAME)}")
    if threads is not None:
        if not 1 <= threads <= (os.cpu_count() or 1):
            raise InputError("threads", threads, f"must be in 1..{os.cpu_count()} (this machine's CPUs)")
        torch.set_num_threads(threads)
    if out is not None:
        output_file(out, "out")
    parallel = EngineConfig(tensor_parallel=tensor_parallel, expert_parallel=expert_parallel)  # --ep N alone: N ranks
    cpus, per_rank = os.cpu_count() or 1, threads or torch.get_num_threads()
    if parallel.tensor_parallel * per_rank > cpus:  # ranks sharing a CPU would time each other's waits
        raise InputError("tp" if expert_parallel == 1 else "ep", parallel.tensor_parallel,
                         f"times {per_rank} thread(s) a rank must be at most this machine's {cpus} CPUs")
    info = detect_device(device)
    cm_dtype = SHORT_NAME[dtype]
    block_size = 16
    engine_settings: dict[str, object] = {"device": info.kind, "dtype": dtype, "random_weights": random_weights,
                                          "block_size_tokens": block_size, "max_num_batched_tokens": 4096,
                                          "max_num_seqs": 64}
    probe = LLM(model_name, num_kv_blocks=1, **engine_settings)
    config = probe.config
    grid = step_grid(quick, config.max_position_embeddings)
    del probe
    micro = micro_benchmarks(info.kind, cm_dtype, quick)
    profile = local_profile(info, micro, cm_dtype)
    # Steps on several ranks scatter widely between repeats on a shared machine, and the fit must
    # split their time into communication and work from them: a parallel calibration takes more
    # repeats, for a median that moves less (docs/validation.md has runs with 3, 7 and 9). The
    # repeats are spread over three passes over the grid (`measure_interleaved`).
    repeats, passes = (2, 1) if quick else ((9, 3) if parallel.tensor_parallel > 1 else (3, 3))
    blocks = grid_blocks_needed(grid, block_size, -(-repeats // passes))
    llm = LLM(model_name, num_kv_blocks=max(blocks, kv_copy_block_counts(config.kv_bytes_per_token(cm_dtype) * block_size)[1]),
              enable_prefix_caching=False, **engine_settings)
    micro = micro.model_copy(update={"kv_copies": kv_copy_benchmarks(llm, 3 if quick else 5)})
    profile = local_profile(info, micro, cm_dtype)
    profile_path = PROFILE_DIR / f"{profile.name}.yaml"
    if write_profile and not profile_path.exists():
        profile_path.write_text(yaml.safe_dump(profile.model_dump(mode="json", exclude_none=True), sort_keys=False))
        hardware_catalog.cache_clear()
    # The same grid on the ranks, interleaved with the one-process grid.
    ranked_engine = LLM(model_name, num_kv_blocks=blocks, enable_prefix_caching=False,
                        tensor_parallel=parallel.tensor_parallel, expert_parallel=expert_parallel,
                        threads=torch.get_num_threads(), **engine_settings) if parallel.tensor_parallel > 1 else None
    llms = [llm] if ranked_engine is None else [llm, ranked_engine]
    with Progress(console=Console(stderr=True), disable=not progress) as bar:
        where = f" on 1 and {parallel.tensor_parallel} processes" if ranked_engine else ""
        task = bar.add_task(f"timing {len(grid)} engine steps of {model_name}{where}", total=len(grid) * passes)
        one, *ranked = measure_interleaved(llms, grid, repeats, passes, progress=lambda: bar.advance(task))
    del llms, llm, ranked_engine
    steps = one + [s.model_copy(update={"tensor_parallel": parallel.tensor_parallel, "expert_parallel": expert_parallel})
                   for s in (ranked[0] if ranked else [])]
    dep = Deployment(hardware=profile.name, weight_dtype=cm_dtype, kv_dtype=cm_dtype, engine=OWN_ENGINE_PROFILE,
                     knobs=EngineKnobs(block_size_tokens=block_size))
    params, predicted = fit_cost_params(config, profile, dep, steps)
    steps = [s.model_copy(update={"predicted_s": p}) for s, p in zip(steps, predicted, strict=True)]
    errors = [abs(s.predicted_s / s.measured_s - 1) * 100 for s in steps]
    cal = Calibration(
        created_utc=dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat(),
        device=info,
        hardware_profile=profile.name,
        profile=profile,
        model=config.name or model_name,
        model_fingerprint=model_fingerprint(config),
        dtype=cm_dtype,
        block_size_tokens=block_size,
        microbenchmarks=micro,
        steps=steps,
        params=asdict(params),
        fit_median_abs_error_pct=float(np.median(errors)),
        fit_max_abs_error_pct=float(max(errors)),
        notes=[
            "steps timed by the engine's step loop (schedule, tensor building, forward pass, sampling) over real "
            "requests whose cached context is external KV, median of repeats",
            "fit: scipy.optimize.least_squares on relative error of CostModel.step_time over the grid",
            "attention_pairs='dense': the torch reference path computes the whole masked score matrix",
            f"torch threads: {torch.get_num_threads()}" if info.kind == "cpu" else f"GPU: {info.name}",
        ],
    )
    ranks = (f"__ep{expert_parallel}" if expert_parallel > 1 else f"__tp{parallel.tensor_parallel}"
             ) if parallel.tensor_parallel > 1 else ""
    path = Path(out) if out else CALIBRATION_DIR / f"{profile.name}__{_slug(config.name or model_name)}__{cm_dtype}{ranks}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(cal.model_dump_json(indent=1) + "\n")
    return cal, path
