"""A step reduced to what the operators need: row counts and attention work, in one pass.

The fields are floats for one step (the simulator) or numpy arrays over many steps (the public
fit evaluates a whole run's steps at once); the operator formulas are written for both.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Generic, TypeVar

import numpy as np

from engine.config import ModelConfig, graph_batch_size
from engine.core.bulk_decodes import NO_BULK, BulkShape
from engine.core.scheduler import SchedulerOutput

Number = float | np.ndarray
# A StepShape's field type: float for one step, np.ndarray (or, in a bulk run, some fields of each)
# for many. Covariant: a shape is never changed after it is made (dataclasses.replace makes a new one).
N_co = TypeVar("N_co", bound=Number, covariant=True)


@dataclass
class StepShape(Generic[N_co]):
    tokens: N_co  # real rows of the step (known tokens + drafts)
    dense_rows: N_co  # rows the dense operators run: tokens, or the captured graph's padded size
    requests: N_co  # scheduled requests (what per-request host work scales with)
    sampled_rows: N_co  # rows that reach the LM head: 1 + drafts per sampling request
    decode_tokens: N_co
    prefill_tokens: N_co
    # Attention work summed over layers (windowed layers count their window only): causal
    # (query, key) pairs, and KV tokens read, of the decode and the prefill group.
    decode_pairs: N_co
    decode_kv: N_co
    prefill_pairs: N_co
    prefill_kv: N_co
    graph: N_co  # 1 when the step replays a captured graph, else 0
    # 1 when that graph stops at every layer's attention, which runs eagerly between its pieces (vLLM
    # V1's piecewise graphs, for steps that are not a plain decode), else 0
    piecewise: N_co

    @staticmethod
    def stack(shapes: Sequence[StepShape[float]]) -> StepShape[np.ndarray]:
        """Many steps as one shape of arrays."""
        return StepShape(**{f.name: np.array([getattr(s, f.name) for s in shapes], dtype=float) for f in fields(StepShape)})

    def __len__(self) -> int:
        return int(np.size(self.tokens))


@dataclass(frozen=True)
class GraphPolicy:
    """Which steps replay a captured graph, and at what size."""

    max_batch: int = 0  # 0: every step runs eagerly
    sizes: tuple[int, ...] | None = None  # captured sizes when not ServePlan's/vLLM's 1, 2, 4, 8, 16, ...
    padding: bool = True  # a batch runs as the next captured size; else only an exact size replays
    max_context: int | None = None  # a step whose longest sequence is longer runs eagerly (vLLM V0)
    # Steps with prompt tokens or drafts of up to this many tokens replay piecewise graphs at the
    # captured size (vLLM V1 captures the layers between attentions and runs attention eagerly);
    # 0: such steps run eagerly.
    mixed_max_tokens: int = 0
    piecewise_decode: bool = False  # decode-only steps replay the pieces too, not one whole graph (vLLM 0.8-0.10)

    def batch(self, requests: int, longest: float) -> int | None:
        """The captured size a decode-only step of `requests` one-token requests replays, or None."""
        if not 0 < requests <= self.max_batch or (self.max_context is not None and longest > self.max_context):
            return None
        if self.sizes is None:
            return graph_batch_size(requests, self.max_batch) if self.padding else requests
        fits = [s for s in self.sizes if s <= self.max_batch and (s >= requests if self.padding else s == requests)]
        return min(fits) if fits else None

    def piecewise(self, tokens: float) -> int | None:
        """The captured size a step of `tokens` tokens that is not a plain decode replays piecewise, or None."""
        return graph_batch_size(int(tokens), self.mixed_max_tokens)


class ShapeReader:
    """Turns SchedulerOutputs, or (query tokens, cached tokens, is_prefill) lists, into StepShapes
    for one model and deployment: its window classes, attention kernel and graph policy."""

    def __init__(self, model: ModelConfig, dense_attention: bool, graphs: GraphPolicy) -> None:
        classes: dict[int | None, int] = {}
        for w in model.layer_windows:
            classes[w] = classes.get(w, 0) + 1
        self._windows = tuple(classes.items())  # (window or None, layers)
        self._layers = model.num_layers
        self._full_only = len(self._windows) == 1 and self._windows[0][0] is None
        self._dense = dense_attention
        self._graphs = graphs

    @property
    def reads_bulk_decodes(self) -> bool:
        """Whether a step's bulk decodes (a count and summed context, engine/core/bulk_decodes.py) are
        enough: not when sliding windows make each request's attention depend on its own context."""
        return self._full_only or self._dense

    def read(self, output: SchedulerOutput) -> StepShape[float]:
        if not output.scheduled and self._full_only and not self._dense:
            return self._bulk_only(output.bulk_decodes)  # most steps of a busy replica
        return self.of(((len(s.token_ids), s.num_computed_tokens, s.is_prefill, 1 + s.num_draft_tokens if s.samples else 0)
                        for s in output.scheduled), output.bulk_decodes)

    def of_requests(self, requests: Iterable[tuple[int, int, bool]]) -> StepShape[float]:
        """A step of requests that all sample: (query tokens, cached tokens, is_prefill) each."""
        return self.of((q, c, prefill, 1) for q, c, prefill in requests)

    def of(self, rows: Iterable[tuple[int, int, bool, int]], bulk: BulkShape = NO_BULK) -> StepShape[float]:
        """(query tokens, cached tokens, is_prefill, sampled rows) per request, and bulk decodes (one
        token each, sampling; their summed pairs and KV reads are exact integers, as one by one)."""
        if bulk.num_requests and not self.reads_bulk_decodes:
            raise ValueError("bulk decodes cannot be priced with sliding windows: each request's context is needed")
        if self._dense:
            return self._dense_shape(rows, bulk)
        d_tok = p_tok = d_pairs = d_kv = p_pairs = p_kv = 0.0
        requests = sampled = longest = 0
        pairs: float  # an int where every layer attends to the whole context
        kv: float
        for q, c, prefill, samples in rows:
            requests += 1
            sampled += samples
            longest = max(longest, c + q)
            if self._full_only:  # the common case: every layer attends to the whole context
                pairs, kv = q * (c + (q + 1) * 0.5) * self._layers, (c + q) * self._layers
            else:
                mean_ctx = c + (q + 1) * 0.5
                pairs = kv = 0.0
                for window, layers in self._windows:
                    pairs += layers * q * (mean_ctx if window is None else min(mean_ctx, window))
                    kv += layers * (c + q if window is None else min(c + q, window))
            if prefill:
                p_tok, p_pairs, p_kv = p_tok + q, p_pairs + pairs, p_kv + kv
            else:
                d_tok, d_pairs, d_kv = d_tok + q, d_pairs + pairs, d_kv + kv
        if bulk.num_requests:
            n, context = bulk.num_requests, float(bulk.context_tokens * self._layers)
            requests, sampled, longest = requests + n, sampled + n, max(longest, bulk.max_context_len)
            d_tok, d_pairs, d_kv = d_tok + n, d_pairs + context, d_kv + context
        return self._shape(d_tok, p_tok, requests, sampled, d_pairs, d_kv, p_pairs, p_kv, longest)

    def _bulk_only(self, bulk: BulkShape) -> StepShape[float]:
        """`of` for a step of bulk decodes alone, every layer attending to the whole context: the same floats."""
        n, context = bulk.num_requests, float(bulk.context_tokens * self._layers)
        return self._shape(float(n), 0.0, n, n, context, context, 0.0, 0.0, max(0, bulk.max_context_len))

    def bulk_run(self, first: BulkShape, count: int) -> StepShape[Number]:
        """Up to `count` steps of the bulk decodes `first`, each request a token longer a step
        (engine/core/scheduler.py: Scheduler.bulk_run), with array fields: what `of` gives each step.
        Fewer where a longest context past the captured graphs' would make later steps eager."""
        s: StepShape[Number] = self.of((), first)
        limit = self._graphs.max_context
        if s.graph and limit is not None:
            count = min(count, limit - first.max_context_len + 1)
        i = np.arange(count, dtype=float)
        n = first.num_requests
        if self._dense:  # every decode reads the batch's longest
            kv = float(n) * (first.max_context_len + i) * self._layers
        else:
            kv = (first.context_tokens + i * n) * self._layers
        return replace(s, decode_pairs=kv, decode_kv=kv)

    def _dense_shape(self, rows: Iterable[tuple[int, int, bool, int]], bulk: BulkShape) -> StepShape[float]:
        """Pairs and KV reads of a kernel that neither skips masked pairs nor honours windows: each
        prefill chunk attends to its whole context, every decode to the batch's longest."""
        d_tok = p_tok = p_pairs = p_kv = 0.0
        requests = sampled = d_max = 0
        for q, c, prefill, samples in rows:
            requests += 1
            sampled += samples
            if prefill:
                p_tok += q
                p_pairs += q * (c + q)
                p_kv += c + q
            else:
                d_tok += q
                d_max = max(d_max, c + q)
        if bulk.num_requests:
            requests, sampled, d_tok = requests + bulk.num_requests, sampled + bulk.num_requests, d_tok + bulk.num_requests
            d_max = max(d_max, bulk.max_context_len)
        padded = d_tok * d_max * self._layers
        return self._shape(d_tok, p_tok, requests, sampled, padded, padded, p_pairs * self._layers, p_kv * self._layers,
                           d_max)

    def _shape(self, d_tok: float, p_tok: float, requests: int, sampled: int, d_pairs: float, d_kv: float,
               p_pairs: float, p_kv: float, longest: float) -> StepShape[float]:
        tokens = d_tok + p_tok
        # A decode-only step of one token per request may replay a graph at its captured size; a step
        # with prompt chunks or drafts replays piecewise graphs where the engine captures them (vLLM V1)
        # and otherwise runs eagerly (ServePlan's engine, SGLang, TensorRT-LLM).
        plain = not p_tok and d_tok == requests
        graph = self._graphs.batch(requests, longest) if plain else self._graphs.piecewise(tokens)
        piecewise = bool(graph) and (not plain or self._graphs.piecewise_decode)
        return StepShape(tokens, float(graph or tokens), float(requests), float(sampled), d_tok, p_tok,
                         d_pairs, d_kv, p_pairs, p_kv, 1.0 if graph else 0.0, 1.0 if piecewise else 0.0)
