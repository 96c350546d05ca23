"""LLM: the engine's Python API — load a model, accept requests, run the step loop.

    llm = LLM("smollm2-135m")
    [out] = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16))

The step loop is engine.core's StepLoop (propose, schedule, execute, update) with the model
runner as its executor and the wall clock as its clock.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
import itertools
import os
import threading
import time
from typing import TYPE_CHECKING, cast

from pydantic import ValidationError
import torch

from engine.config import EngineConfig, tier_blocks
from engine.core import Executor, KVCacheManager, Request, RequestUpdate, SamplingParams, Scheduler, SpecStats, StepLoop
from engine.core.metrics import RequestMetrics
from engine.dtypes import ENGINE_DTYPES
from engine.errors import InputError, from_validation_error
from engine.graphs import compile_recorder, cuda_graph_recorder
from engine.kernels import triton_available
from engine.catalog import resolve_model
from engine.kv_offload import TierStore
from engine.model.loader import LoadedModel, load_model
from engine.parallel.executor import WorkerPool
from engine.parallel.layers import check_shardable
from engine.quant.kv import is_quantized_kv, kv_cache_torch_dtype, kv_dtype_name
from engine.runner import ModelRunner
from engine.spec.factory import TargetInfo, build_proposer

if TYPE_CHECKING:
    from engine.core import StructuredOutput
    from engine.structured_output import GrammarCompiler

TORCH_DTYPES = {name: getattr(torch, name) for name in ENGINE_DTYPES}
GIB = 2**30


@dataclass
class EngineClock:
    """Seconds since `origin`, a time.perf_counter() value (the system-wide monotonic clock). The
    engine hands this object, not a method of its own, to its step loop: a bound method would make
    the engine and its loop a reference cycle, and the KV cache (1 GiB on a CPU by default) would
    then wait for Python's cycle collector, which large tensors do not prompt, to be freed."""

    origin: float

    def __call__(self) -> float:
        return time.perf_counter() - self.origin


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    metrics: RequestMetrics


@dataclass(frozen=True)
class StreamEvent:
    request_id: str
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None


# Engine settings that decide the loaded weights: changing one needs a new load.
WEIGHT_SETTINGS = ("device", "dtype", "seed", "random_weights", "weight_dtype", "int8_kernel", "lm_head_dtype")


def _engine_config(settings: dict[str, object]) -> EngineConfig:
    try:
        return EngineConfig.model_validate(settings)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def _device(name: str) -> torch.device:
    """The device an engine setting names, checked against what torch can reach here."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise InputError("device", name, "no CUDA device is visible to torch here; use cpu or auto")
        if (device.index or 0) >= count:
            raise InputError("device", name, f"this machine has CUDA devices 0..{count - 1}")
    return device


def _worker_pool(model: str, cfg: EngineConfig, device: torch.device) -> WorkerPool:
    """The ranks of a tensor-parallel engine, once the settings it cannot run are refused."""
    tp = cfg.tensor_parallel
    # setting -> (whether it is asked for, the value to name, why it needs one process)
    one_process: dict[str, tuple[bool, object, str]] = {
        "speculative": (cfg.speculative is not None, cfg.speculative and cfg.speculative.method,
                        "drafts are proposed and verified in one process"),
        "compile_model": (cfg.compile_model, cfg.compile_model, "torch.compile of a step with collectives is not set up"),
        "weight_dtype": (cfg.weight_dtype != "auto", cfg.weight_dtype, "quantised weights are not sharded across ranks"),
    }
    for name, (asked, value, why) in one_process.items():
        if asked:
            raise InputError(name, value, f"runs with tensor_parallel=1 only ({why}); tensor_parallel={tp}")
    if device.type == "cuda":
        if device.index is not None:
            raise InputError("device", cfg.device, f"a tensor-parallel engine uses cuda:0..cuda:{tp - 1}; give 'cuda'")
        if torch.cuda.device_count() < tp:
            raise InputError("tensor_parallel", tp, f"needs one GPU per rank; {torch.cuda.device_count()} are visible")
    try:  # catalog names and config files: refuse a split the shapes forbid before any process starts
        config = resolve_model(model)
    except InputError:
        config = None  # a checkpoint folder or GGUF file: the ranks check once they have read it
    if config is not None:
        check_shardable(config, tp, cfg.expert_parallel)
    # Each rank gets its share of the threads (or what was asked for each), never more than the cores.
    threads = cfg.threads or max(1, torch.get_num_threads() // tp)
    return WorkerPool(model, cfg, device, threads)


class LLM:
    def __init__(self, model: str, **engine_config: object) -> None:
        cfg = _engine_config(engine_config)
        device = _device(cfg.device)
        if cfg.threads is not None and device.type == "cpu":
            if cfg.threads > (os.cpu_count() or 1):  # more threads than CPUs only ever wait on each other
                raise InputError("threads", cfg.threads, f"must be in 1..{os.cpu_count()} (this machine's CPUs)")
            torch.set_num_threads(cfg.threads)
        if cfg.int8_kernel == "dynamic" and device.type != "cpu":
            raise InputError("int8_kernel", "dynamic", f"runs on the CPU only; the engine chose {device}")
        if cfg.tensor_parallel > 1:
            self._start(_worker_pool(model, cfg, device), cfg, device)
            return
        loaded = load_model(model, dtype=TORCH_DTYPES[cfg.dtype], device=device, seed=cfg.seed,
                            random_weights=cfg.random_weights, weight_dtype=cfg.weight_dtype, int8_kernel=cfg.int8_kernel,
                            lm_head_dtype=cfg.lm_head_dtype)
        self._start(loaded, cfg, device)

    def with_settings(self, **changes: object) -> LLM:
        """Another engine over the same loaded weights, without reloading them: its own scheduler,
        KV cache and runner, with engine settings changed (those that decide the weights cannot)."""
        cfg = self.engine_config
        for name in WEIGHT_SETTINGS:
            if name in changes and changes[name] != getattr(cfg, name):
                raise InputError(name, changes[name], f"decides the loaded weights (here {getattr(cfg, name)!r}); "
                                 "load a new LLM to change it")
        other = LLM.__new__(LLM)
        other._start(self._loaded, _engine_config({**cfg.model_dump(), **changes}), self.device)
        return other

    def _start(self, loaded: LoadedModel | WorkerPool, cfg: EngineConfig, device: torch.device) -> None:
        """The engine over loaded weights: in this process (a LoadedModel), or in the ranks of a
        tensor-parallel engine (a WorkerPool, whose executor stands where the runner would)."""
        self.engine_config, self._loaded, self.device = cfg, loaded, device
        dtype = TORCH_DTYPES[cfg.dtype]
        self.model, self.config, self.tokenizer = loaded.model, loaded.config, loaded.tokenizer
        kv_dtype = kv_cache_torch_dtype(cfg.kv_cache_dtype, dtype)
        self.max_model_len = cfg.max_model_len or self.config.max_position_embeddings
        if self.max_model_len > self.config.max_position_embeddings:
            raise InputError("max_model_len", self.max_model_len,
                             f"must not exceed the model's max_position_embeddings={self.config.max_position_embeddings}")
        self.num_blocks = cfg.num_kv_blocks or self._blocks_that_fit(device, kv_dtype)
        self.host_blocks, self.disk_blocks = self._tier_blocks(kv_dtype)
        choices = cfg.choices  # EngineConfig fills in every knob left to the engine (ENGINE_DEFAULTS)
        self.scheduler = Scheduler(
            cfg.scheduler_config(self.max_model_len),
            KVCacheManager(self.num_blocks, choices.block_size_tokens, choices.enable_prefix_caching,
                           self.host_blocks, self.disk_blocks),
        )
        self.runner: ModelRunner | None = None
        # The engine's clock (now() reads it): whatever keeps time for the engine's own parts takes this
        # object, not now(), so that none of them holds the engine (EngineClock).
        self.clock = EngineClock(time.perf_counter())
        if isinstance(loaded, WorkerPool):
            self.executor: Executor = loaded.executor(self.num_blocks, choices.block_size_tokens, kv_dtype, cfg.seed)
            self.loop = StepLoop(self.scheduler, self.executor, self.clock)
        else:
            self.executor = self.runner = self._runner(loaded, cfg, kv_dtype, device)
            spec = cfg.speculative
            proposer = None if spec is None else build_proposer(spec, TargetInfo(
                loaded.model, self.config, self.tokenizer, self.max_model_len, self.num_blocks, choices.block_size_tokens,
                choices.max_num_seqs, kv_dtype, dtype, device, cfg.seed, cfg.random_weights))
            self.loop = StepLoop(self.scheduler, self.runner, self.clock, proposer=proposer)
        self._ids = itertools.count()
        self.clock.origin = time.perf_counter()  # time runs from the end of start-up
        self.eos_token_id = self.tokenizer.eos_token_id if self.tokenizer is not None else (
            self.config.eos_token_ids[0] if self.config.eos_token_ids else None)
        self._grammar_compiler: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()  # a server's front end checks constraints on its own thread

    def _runner(self, loaded: LoadedModel, cfg: EngineConfig, kv_dtype: torch.dtype, device: torch.device) -> ModelRunner:
        choices = cfg.choices
        runner = ModelRunner(loaded.model, self.config, self.num_blocks, choices.block_size_tokens, kv_dtype, device, cfg.seed)
        if self.host_blocks:
            runner.tiers = TierStore(runner.kv_caches, self.host_blocks, self.disk_blocks, cfg.kv_offload_disk_path)
        # Only the Triton kernels are capturable: the torch reference path (quantised KV caches, no
        # triton) syncs on data-dependent shapes, and so does MoE routing (tokens per expert are
        # counted on the host), so those engines stay eager.
        capturable = (device.type == "cuda" and not is_quantized_kv(kv_dtype) and triton_available(device)
                      and self.config.moe is None)
        record = cuda_graph_recorder(device) if capturable and not cfg.enforce_eager else None
        if cfg.compile_model:
            record = compile_recorder(then=record)
        if record is not None:
            max_graph_batch = min(choices.max_graph_batch_size, choices.max_num_seqs)
            runner.capture_decode_graphs(max_graph_batch, self.max_model_len, record)
        return runner

    def now(self) -> float:
        """Seconds since the engine started; the scheduler is always handed this clock."""
        return self.clock()

    def share_clock(self, origin: float) -> None:
        """Measure time from `origin`, a time.perf_counter() value, instead of the engine's start:
        engines in several processes of one machine then stamp requests on one clock
        (perf_counter is the system-wide monotonic clock). Before any request is added."""
        if self.scheduler.requests:
            raise RuntimeError("share_clock() must come before the first request")
        self.clock.origin = origin

    def _blocks_that_fit(self, device: torch.device, kv_dtype: torch.dtype) -> int:
        cfg = self.engine_config
        if cfg.kv_cache_gib is not None:
            budget = cfg.kv_cache_gib * GIB
        elif device.type == "cuda":
            # A tensor-parallel engine's weights live in its ranks: the fullest rank decides.
            free, total = (min(self._loaded.call("memory_info")) if isinstance(self._loaded, WorkerPool)
                           else torch.cuda.mem_get_info(device))
            budget = free - total * (1 - cfg.choices.gpu_memory_utilization)
        else:
            budget = 1.0 * GIB
        blocks = int(budget // self.kv_bytes_per_block(kv_dtype))
        if blocks < 1:
            raise InputError("kv_cache_gib", cfg.kv_cache_gib, "leaves no room for a single KV block")
        return blocks

    def _tier_blocks(self, kv_dtype: torch.dtype) -> tuple[int, int]:
        """Blocks of the host and disk tiers; the host tier is checked against this machine's
        memory before any of it is allocated."""
        cfg, block_bytes = self.engine_config, self.kv_bytes_per_block(kv_dtype)
        host, disk = tier_blocks(cfg.kv_offload_host_gib, block_bytes), tier_blocks(cfg.kv_offload_disk_gib, block_bytes)
        for name, gib, blocks in (("kv_offload_host_gib", cfg.kv_offload_host_gib, host),
                                  ("kv_offload_disk_gib", cfg.kv_offload_disk_gib, disk)):
            if gib and not blocks:
                raise InputError(name, gib, f"holds no KV block of {block_bytes:,} bytes; give at least {block_bytes / GIB:.3g}")
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if host * block_bytes > physical / 2:
            raise InputError("kv_offload_host_gib", cfg.kv_offload_host_gib,
                             f"must leave half of this machine's {physical / GIB:.1f} GiB of memory to everything else")
        return host, disk

    def kv_bytes_per_block(self, kv_dtype: torch.dtype) -> int:
        """Real bytes of one KV block across all layers in one process (quantised caches count their
        scales): ModelConfig's count, the same the planner's memory plan uses; a tensor-parallel
        rank holds its own KV heads only."""
        cfg = self.engine_config
        whole = self.config.kv_bytes_per_token(kv_dtype_name(kv_dtype)) * cfg.choices.block_size_tokens
        heads = self.config.num_kv_heads
        return whole * max(1, heads // cfg.tensor_parallel) // heads

    # ------------------------------------------------------------------ requests

    def encode(self, prompt: str | Sequence[int], chat: bool = False) -> list[int]:
        if not isinstance(prompt, str):
            ids = [int(t) for t in prompt]
            if any(not 0 <= t < self.config.vocab_size for t in ids):
                raise InputError("prompt", ids[:8], f"token ids must lie in [0, {self.config.vocab_size})")
            return ids
        if self.tokenizer is None:
            raise InputError("prompt", prompt[:40], "this model has no tokenizer; pass token ids")
        if chat:
            messages = [{"role": "user", "content": prompt}]
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return self.tokenizer.encode(text, add_special_tokens=False)  # the template wrote them already
        return self.tokenizer.encode(prompt)

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        arrival_time: float | None = None,
        chat: bool = False,
        priority: int = 0,
    ) -> str:
        if params.structured_output is not None:
            self.check_structured_output(params.structured_output)
        request = Request(
            request_id=request_id if request_id is not None else f"req-{next(self._ids)}",
            prompt_token_ids=self.encode(prompt, chat),
            sampling_params=params,
            arrival_time=self.now() if arrival_time is None else arrival_time,
            eos_token_id=self.eos_token_id,
            priority=priority,
        )
        try:
            self.scheduler.add_request(request)
        except ValueError as exc:
            raise InputError("prompt", f"{request.num_prompt_tokens} tokens", str(exc)) from None
        return request.request_id

    def step(self) -> list[RequestUpdate]:
        return self.loop.step()

    def check_structured_output(self, constraint: StructuredOutput) -> None:
        """Refuse a constraint this engine cannot apply; compile it into the cache the sampler
        reads. Thread-safe, so a server can check a request before it reaches the engine."""
        if self.runner is None:
            raise InputError("structured_output", constraint.kind, "runs in one process only: the grammar masks the "
                             "sampler's logits, which a tensor-parallel engine samples in its first rank")
        if self.engine_config.speculative is not None:
            raise InputError("structured_output", constraint.kind, "is not supported with speculative decoding: "
                             "drafts are verified without grammar masks; run the engine without speculation")
        if self.tokenizer is None:
            raise InputError("structured_output", constraint.kind, "needs the model's tokenizer, and this model has none")
        with self._grammar_lock:
            if self._grammar_compiler is None:
                from engine.structured_output import GrammarCompiler, GrammarMasks

                self._grammar_compiler = GrammarCompiler(self.tokenizer, self.config.vocab_size, self.eos_token_id)
                self.runner.sampler.grammars = GrammarMasks(self._grammar_compiler)
        self._grammar_compiler.compile(constraint)

    @property
    def spec_stats(self) -> SpecStats | None:
        """Acceptance per draft position, accepted length, draft and verify time; None without speculation."""
        return self.loop.spec_stats

    # ------------------------------------------------------------------ batch and streaming

    def submit(
        self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | Sequence[SamplingParams], chat: bool = False
    ) -> list[str]:
        """Add every prompt (one SamplingParams for all, or one each); returns their request ids."""
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(prompts):
            raise InputError("params", len(per_prompt), f"give one SamplingParams or one per prompt ({len(prompts)})")
        return [self.add_request(p, sp, chat=chat) for p, sp in zip(prompts, per_prompt, strict=True)]

    def run_until_finished(self, request_ids: Sequence[str]) -> Iterator[StreamEvent]:
        """Step until every given request has finished, yielding their tokens as they come."""
        pending = set(request_ids)
        while pending:
            for update in self.step():
                if update.request_id in pending:
                    if update.finished:
                        pending.discard(update.request_id)
                    yield StreamEvent(update.request_id, update.new_token_ids, update.finished, update.finish_reason)

    def stream(
        self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | Sequence[SamplingParams], chat: bool = False
    ) -> Iterator[StreamEvent]:
        return self.run_until_finished(self.submit(prompts, params, chat))

    def generate(
        self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | Sequence[SamplingParams], chat: bool = False
    ) -> list[RequestOutput]:
        request_ids = self.submit(prompts, params, chat)
        for _ in self.run_until_finished(request_ids):
            pass
        return [self.output(request_id) for request_id in request_ids]

    def output_text(self, request_id: str) -> str:
        tokens = self.scheduler.get_request(request_id).output_token_ids
        # One list of ids decodes to one str (transformers' return type covers a batch of lists too).
        return cast(str, self.tokenizer.decode(tokens, skip_special_tokens=True)) if self.tokenizer is not None else ""

    def output(self, request_id: str) -> RequestOutput:
        request = self.scheduler.get_request(request_id)
        tokens = list(request.output_token_ids)
        text = self.output_text(request_id)
        return RequestOutput(
            request_id=request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            token_ids=tokens,
            text=text,
            finish_reason=request.finish_reason,
            metrics=RequestMetrics.from_request(request),
        )
