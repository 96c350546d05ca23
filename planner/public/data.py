"""Published GPU serving measurements and engine start-up logs: the data ServePlan's GPU fidelity
is fitted to and checked against, each entry with its source and the conditions it was run under.

Two files under planner/data/, validated by the models below:
- `public_measurements.json`: one benchmark run per entry, with the engine, its flags, the
  benchmark client's semantics and the request lengths as published, so the simulator can replay
  it as it was run, and the figures it produced (throughputs and latency statistics);
- `startup_logs.json`: what an engine reported about its memory at start-up (weights, KV-cache
  GiB and tokens, activation peak, CUDA-graph memory) for one deployment.

Entries are grouped by `source_key` (one publication: a document, a blog post, an issue): the
fit's headline error is leave-one-source-out, so a source never checks a fit that saw it.
Sources reserved for an independent check (`is_reserved`) must never appear here; a test
enforces it.
"""

from __future__ import annotations

from functools import cache
import hashlib
import json
from pathlib import Path
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from planner.metrics import ArrivalRegime, MetricFamily
from planner.specs import Dtype, ProfileSampler

DATA_DIR = Path(__file__).resolve().parents[1] / "data"
MEASUREMENTS_FILE = DATA_DIR / "public_measurements.json"
STARTUP_LOGS_FILE = DATA_DIR / "startup_logs.json"

# Kept out of every fit and test so that an independent check can use them (issue 16). Stored as
# digests of URL fragments (a host label, or a run of host and path segments), so the project does
# not name them; `is_reserved` recognises a URL containing one.
RESERVED_SOURCE_DIGESTS: frozenset[str] = frozenset({
    "0b03075f6dbe9141",
    "1fe976f8b3f36795",
    "3763f875996d6cb6",
    "3b0e0440605d75b0",
    "4670b54f5c00f41f",
    "56f2df1538e8224a",
    "6c0954c0f83e6559",
    "7ac630bcdf01c812",
    "7e8c8910db1beebc",
    "a9131bbbf5316c9b",
})


def is_reserved(url: str) -> bool:
    """Whether `url` contains a fragment of a source reserved for the independent check."""
    segments = [s for s in re.sub(r"^[a-z]+://", "", url.lower()).split("/") if s]
    fragments = {"/".join(segments[i:j]) for i in range(len(segments)) for j in range(i + 1, len(segments) + 1)}
    fragments |= {label for label in segments[0].split(".")} if segments else set()
    return any(hashlib.sha256(f.encode()).hexdigest()[:16] in RESERVED_SOURCE_DIGESTS for f in fragments)


Metric = Literal[
    "request_throughput", "output_throughput", "total_throughput", "input_throughput",
    "ttft_mean", "ttft_median", "ttft_p99",
    "tpot_mean", "tpot_median", "tpot_p99",
    "itl_mean", "itl_median", "itl_p99",
    "e2e_mean", "e2e_median", "e2e_p99",
]


def metric_family(metric: Metric) -> MetricFamily:
    if metric.endswith("throughput"):
        return "throughput"
    if metric.startswith(("tpot_", "itl_")):
        return "tpot_itl"
    return "ttft" if metric.startswith("ttft_") else "e2e"


class _Data(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EngineRun(_Data):
    """The serving engine as the source ran it."""

    engine: Literal["vllm", "sglang", "trtllm"]
    version: str = Field(description="As published, e.g. '0.11.0', '0.5.5.post1', '1.2.0rc1'; 'unknown' if unstated")
    args: dict[str, int | float | bool | str] = Field(
        default_factory=dict,
        description="Flags that change behaviour, with the engine's own names: max_num_seqs, max_num_batched_tokens, "
        "num_scheduler_steps, enable_chunked_prefill, enable_prefix_caching (or disable_radix_cache), "
        "enable_torch_compile, max_model_len, gpu_memory_utilization (mem_fraction_static), enforce_eager, "
        "attention_backend, kv_cache_dtype, speculative settings... Defaults left out.",
    )
    profile_sampler: ProfileSampler | None = Field(
        None, description="The top-k/top-p sampler the run's installation profiled memory with (vLLM), where the "
        "source's image or logs show it: an installation fact, not a flag; None: the engine profile's")
    profile_sampler_source: str | None = Field(
        None, max_length=500, description="Where profile_sampler is shown (the image's build file, a log)")
    kv_cache_gib_reported: float | None = Field(
        None, gt=0, description="KV-cache memory per GPU the engine reported at start-up, where the run's source "
        "prints it: the replay sizes the cache to it (kv_cache_gib), whatever flags led there")

    @model_validator(mode="after")
    def _sampler_with_its_source(self) -> EngineRun:
        if (self.profile_sampler is None) != (self.profile_sampler_source is None):
            raise ValueError("profile_sampler and profile_sampler_source are set together")
        return self


class Lengths(_Data):
    """Request lengths as the benchmark drew them."""

    dataset: Literal["sharegpt", "random", "fixed"]
    input_tokens: int | None = Field(None, ge=1, description="random/fixed: the nominal prompt length")
    output_tokens: int | None = Field(None, ge=1, description="random/fixed: the nominal output length")
    random_range_ratio: float | None = Field(
        None, ge=0, le=1, description="random: the client's --random-range-ratio r as run; its meaning depends on "
        "client.tool: vllm-bench-serve draws lengths uniformly in [L(1-r), L(1+r)] (default 0: exact lengths), "
        "sglang-bench-serving draws inputs in [max(1, rL), L] and outputs in [rL, L] (default 0: uniform below L)"
    )
    mean_input_tokens: float | None = Field(None, gt=0, description="Published totals / prompts, when given")
    mean_output_tokens: float | None = Field(None, gt=0, description="Published totals / prompts, when given")
    tokenizer: str | None = Field(None, description="Whose tokenizer counted ShareGPT's lengths, e.g. 'llama-3', 'qwen3'")
    sharegpt_rules: Literal["vllm", "sglang"] | None = Field(
        None, description="sharegpt: which pairs the client dropped: 'vllm' (a side under 4 tokens, a prompt over 1024, a "
        "pair over 2048: vLLM's client, and SGLang's before its January 2025 change) or 'sglang' (a side under 2 tokens "
        "only); None: the rules of the client tool as it is now")

    @model_validator(mode="after")
    def _nominal_for_synthetic(self) -> Lengths:
        if self.dataset != "sharegpt" and (self.input_tokens is None or self.output_tokens is None):
            raise ValueError(f"dataset {self.dataset!r} needs input_tokens and output_tokens")
        return self


class PriorRun(_Data):
    """A run the same client sent the same server before this one, with the same dataset and seed."""

    num_prompts: int = Field(ge=1)
    input_tokens: int = Field(ge=1)
    output_tokens: int = Field(ge=1)


class Client(_Data):
    """The benchmark client's semantics: how requests were offered."""

    tool: Literal["vllm-bench-serve", "sglang-bench-serving", "vllm-benchmark-throughput", "genai-perf", "other"]
    arrival: Literal["offline", "poisson", "closed_loop"] = Field(
        description="offline: every request at t=0 (rate inf; also in-process throughput runs); poisson: open loop at "
        "request_rate_per_s, optionally capped by max_concurrency; closed_loop: max_concurrency users back to back"
    )
    request_rate_per_s: float | None = Field(None, gt=0)
    max_concurrency: int | None = Field(None, ge=1)
    num_prompts: int = Field(ge=1)
    endpoint: Literal["chat", "completions", "in-process"] = Field(
        description="chat/completions: through the engine's HTTP server (TTFT includes it); in-process: no server"
    )
    streaming: bool = True
    served_before: tuple[PriorRun, ...] | None = Field(
        None, description="The runs this client sent the server since it started, in order, where the publication "
        "shows them all (its logged prefix-cache hit rates agree with them): prompt i of a run of the same lengths is "
        "this run's prompt i, so the server's prefix cache starts warm. None: not published; the replay starts from "
        "an empty cache")
    served_unpublished: bool = Field(
        False, description="The publication's logged prefix-cache hit rate shows the server had served this run's "
        "prompts in runs it does not list: the cache at the start is unknown, so the run's TTFT figures are set aside")

    @model_validator(mode="after")
    def _consistent(self) -> Client:
        if self.arrival == "poisson" and self.request_rate_per_s is None:
            raise ValueError("poisson arrivals need request_rate_per_s")
        if self.arrival == "closed_loop" and self.max_concurrency is None:
            raise ValueError("closed_loop arrivals need max_concurrency")
        if self.served_unpublished and self.served_before is not None:
            raise ValueError("served_before lists the server's whole history: it cannot also be unpublished")
        return self

    @property
    def regime(self) -> ArrivalRegime:
        """'offline': every request at once, none held back; 'online': over time, or users back to
        back (the replay's Replay.regime says the same of the requests it plays)."""
        return "offline" if self.arrival == "offline" and self.max_concurrency is None else "online"

    @property
    def setup(self) -> str:
        """How the requests were offered, in the classes the validation report groups by: every request
        at once, an open-loop Poisson stream, or a few / many users back to back."""
        if self.arrival == "closed_loop":
            assert self.max_concurrency is not None  # _consistent
            return "closed loop, 1-4 users" if self.max_concurrency <= 4 else "closed loop, 5+ users"
        return "Poisson arrivals" if self.arrival == "poisson" else "offline (every request at once)"


class Deployment(_Data):
    """What served the run, in ServePlan's names."""

    model: str = Field(description="Catalog name (`serveplan models list`)")
    model_as_published: str
    hardware: str = Field(description="Hardware profile name (`serveplan hw list`)")
    gpu_as_published: str
    num_gpus: int = Field(ge=1)
    tensor_parallel: int = Field(1, ge=1)
    pipeline_parallel: int = Field(1, ge=1)
    data_parallel: int = Field(1, ge=1)
    expert_parallel: int = Field(1, ge=1)
    weight_dtype: Dtype
    kv_dtype: Dtype
    quantization_as_published: str = Field("", description="e.g. 'FP8 dynamic', 'AWQ int4', '' for none")
    peer_access: bool = Field(True, description="False where the source shows the GPUs had no peer access (vLLM: "
                              "'Custom allreduce is disabled because your platform lacks GPU P2P capability')")
    peer_access_source: str | None = Field(None, max_length=500, description="Where the lack of peer access shows")

    @model_validator(mode="after")
    def _no_peer_access_with_its_source(self) -> Deployment:
        if self.peer_access != (self.peer_access_source is None):
            raise ValueError("peer_access_source is given exactly when peer_access is false")
        return self


class Figure(_Data):
    """One published figure of a run."""

    id: str = Field(pattern=r"^[a-z0-9][a-z0-9._\-]*$")
    metric: Metric
    value: float = Field(gt=0)
    unit: Literal["req/s", "tokens/s", "ms"]
    source_url: str | None = Field(None, description="Where it is printed, when not at the run's source_url")

    @model_validator(mode="after")
    def _unit_matches(self) -> Figure:
        expected = "ms" if metric_family(self.metric) != "throughput" else (
            "req/s" if self.metric == "request_throughput" else "tokens/s")
        if self.unit != expected:
            raise ValueError(f"{self.metric} is in {expected}, not {self.unit}")
        return self

    @property
    def family(self) -> MetricFamily:
        return metric_family(self.metric)


class PublicRun(_Data):
    """One benchmark run as published: its conditions once, its figures under it (one simulation)."""

    run_key: str
    source_key: str = Field(description="One publication; the unit left out in leave-one-source-out")
    source_url: str
    deployment: Deployment
    engine: EngineRun
    client: Client
    lengths: Lengths
    confidence: Literal["high", "medium", "low"]
    notes: str = ""
    figures: tuple[Figure, ...] = Field(min_length=1)

    @property
    def publisher(self) -> str:
        """Who published it (the GitHub owner of its URL): a stricter unit to leave out than the
        source, since one lab's pages share its harness, engine builds and habits."""
        parts = self.source_url.split("://", 1)[-1].split("/")
        return parts[1] if parts[0] == "github.com" and len(parts) > 1 else parts[0]

    @model_validator(mode="after")
    def _one_figure_per_metric(self) -> PublicRun:
        metrics = [f.metric for f in self.figures]
        if len(metrics) != len(set(metrics)):
            raise ValueError(f"run {self.run_key!r} gives a metric twice")
        for prior in self.client.served_before or ():
            # vLLM's random prompts of other lengths share prefixes with these, which the replay does not draw.
            if (self.lengths.dataset != "random" or self.lengths.random_range_ratio not in (None, 0.0)
                    or prior.input_tokens != self.lengths.input_tokens):
                raise ValueError(f"run {self.run_key!r}: served_before is replayed for random prompts of the run's "
                                 f"own input length ({self.lengths.input_tokens}), not {prior.input_tokens}")
        return self


class StartupReport(_Data):
    """What the engine printed about its memory; None where the log does not say."""

    weights_gib: float | None = Field(None, gt=0, description="vLLM: 'Model loading took X GiB'")
    kv_cache_gib: float | None = Field(
        None, description="vLLM: 'Available KV cache memory: X GiB' (negative when the engine found no room and refused "
        "to start); SGLang: K size + V size of 'KV Cache is allocated'")
    kv_cache_tokens: int | None = Field(None, gt=0, description="vLLM: 'GPU KV cache size: N tokens'")
    num_gpu_blocks: int | None = Field(None, gt=0, description="'# GPU blocks: N' (older vLLM)")
    activation_peak_gib: float | None = Field(None, ge=0, description="'torch peak memory increase' of the profile run")
    non_torch_gib: float | None = Field(None, ge=0, description="'non-torch memory' (NCCL buffers, CUDA context)")
    cuda_graph_gib: float | None = Field(
        None, description="'Graph capturing finished ... took X GiB': the change of free memory around capture, which "
        "vLLM can print negative")
    max_concurrency: float | None = Field(None, gt=0, description="'Maximum concurrency for N tokens per request: X'")
    total_gpu_memory_gib: float | None = Field(None, gt=0, description="Device memory the engine saw, when printed")
    free_gpu_memory_gib: float | None = Field(
        None, gt=0, description="'Free memory on device (free/total GiB) on startup', before the engine allocated anything")


class StartupLog(_Data):
    id: str = Field(pattern=r"^[a-z0-9][a-z0-9._\-]*$")
    source_url: str
    source_key: str
    deployment: Deployment
    engine: EngineRun = Field(description="args: gpu_memory_utilization, max_model_len, max_num_seqs, "
                              "max_num_batched_tokens, enforce_eager, kv_cache_dtype, block_size... as launched")
    reported: StartupReport
    log_excerpt: str = Field(max_length=2000, description="The quoted lines the figures come from")
    confidence: Literal["high", "medium", "low"]
    notes: str = ""


class _MeasurementFile(_Data):
    about: str
    attribution: str
    runs: list[PublicRun]


class _StartupFile(_Data):
    about: str
    attribution: str
    logs: list[StartupLog]


@cache
def public_runs() -> tuple[PublicRun, ...]:
    return tuple(_MeasurementFile.model_validate(json.loads(MEASUREMENTS_FILE.read_text())).runs)


@cache
def startup_logs() -> tuple[StartupLog, ...]:
    return tuple(_StartupFile.model_validate(json.loads(STARTUP_LOGS_FILE.read_text())).logs)
