"""ModelRunner: the engine's executor. Turns a SchedulerOutput into flat tensors, runs the
model, samples.

The runner owns the tensors the KV-cache manager only names: one paged cache per layer and
each running request's block table, kept in step with the scheduler's block ids.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import nullcontext
import itertools

import torch

from engine.config import ModelConfig
from engine.core import ExecutedStep, KVTransfers, SchedulerOutput
from engine.graphs import DecodeGraphs, Recorder
from engine.kernels.metadata import build_attention_metadata
from engine.kv_offload import ExternalKV, TierStore
from engine.model.attention import allocate_kv_caches
from engine.model.decoder import CausalLM
from engine.model.layers import lay_out_cpu_matmul_weights, weight_of
from engine.sampler import Sampler


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        kv_dtype: torch.dtype,
        device: torch.device,
        seed: int = 0,
    ) -> None:
        self.model, self.config, self.block_size, self.device = model, config, block_size, device
        lay_out_cpu_matmul_weights(model, model.model.embed_tokens)
        self.kv_caches = allocate_kv_caches(config, num_blocks, block_size, kv_dtype, device)
        self.block_tables: dict[str, list[int]] = {}
        self.sampler = Sampler(device, seed)
        self.graphs: DecodeGraphs | None = None
        # False on tensor-parallel ranks but the first: they compute the logits, whose gather
        # every rank joins, and leave sampling to rank 0.
        self.samples = True
        self.tiers: TierStore | None = None  # offload tiers, when the engine has them
        # Externally computed KV (a disaggregated decode worker's transport); without one, external
        # tokens are taken as they lie in their blocks (calibration's synthetic context).
        self.external: ExternalKV | None = None
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def capture_decode_graphs(self, max_batch_size: int, max_model_len: int, record: Recorder) -> None:
        """From now on, decode-only steps of <= max_batch_size requests replay captured graphs."""
        self.graphs = DecodeGraphs(
            lambda ids, positions, metadata: self.model(ids, positions, metadata, self.kv_caches),
            self.config.hidden_size, weight_of(self.model.model.embed_tokens).dtype,
            max_batch_size, max_model_len, self.block_size, self.device, record,
        )

    def forget(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self.block_tables.pop(request_id, None)
            self.sampler.forget(request_id)

    def execute(self, output: SchedulerOutput) -> ExecutedStep:
        """Run one step on the device: its KV copies, then the forward pass; the sampled token ids
        of every request that samples."""
        if output.kv_transfers is not None:
            self._transfer(output.kv_transfers)
        return ExecutedStep(self._run(output))

    @torch.inference_mode()
    def _transfer(self, transfers: KVTransfers) -> None:
        """The step's copies, in order. On CUDA they go on a side stream, after the previous step's
        writes, and overlap the host building this step's inputs; _run waits for them."""
        stream = self._copy_stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            if transfers.copies:
                if self.tiers is None:
                    raise RuntimeError("the scheduler listed tier copies, but this runner has no offload tiers")
                self.tiers.copy(transfers)
            for load in transfers.external:
                if self.external is None:
                    continue
                blocks = self.external.read(load.request_id, load.first_block, len(load.block_ids))
                index = torch.tensor(load.block_ids, device=self.device)
                for cache, layer in zip(self.kv_caches, blocks, strict=True):
                    cache.index_copy_(1, index, layer.to(self.device, non_blocking=stream is not None))
                self.external.loaded(load.request_id)

    @torch.inference_mode()
    def _run(self, output: SchedulerOutput) -> dict[str, list[int]]:
        if output.is_empty:
            return {}

        input_ids: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        for s in output.scheduled:
            table = None if s.reset_block_table else self.block_tables.get(s.request_id)
            if table is None:
                table = self.block_tables[s.request_id] = list(s.new_block_ids)
            else:
                table.extend(s.new_block_ids)
            input_ids.extend(s.token_ids)
            query_lens.append(s.num_tokens)
            seq_lens.append(s.context_len)
            tables.append(table)
        positions, metadata = build_attention_metadata(query_lens, seq_lens, tables, self.block_size, self.device)
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        if self._copy_stream is not None and output.kv_transfers is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._copy_stream)
        if self.graphs is not None and self.graphs.can_run(query_lens):
            hidden = self.graphs.run(ids, positions, metadata)
        else:
            hidden = self.model(ids, positions, metadata, self.kv_caches)

        sampling = [(i, s) for i, s in enumerate(output.scheduled) if s.samples]
        if not sampling:
            return {}
        ends = list(itertools.accumulate(query_lens))
        request_ids = [s.request_id for _, s in sampling]
        if not any(s.num_draft_tokens for _, s in sampling):
            last_rows = torch.tensor([ends[i] - 1 for i, _ in sampling], device=self.device)
            logits = self.model.compute_logits(hidden[last_rows])
            if not self.samples:
                return {}
            tokens = self.sampler(logits, request_ids, [s.sampling_params for _, s in sampling])
            return {request_id: [token] for request_id, token in zip(request_ids, tokens, strict=True)}
        # Speculative step: a request with d drafts (the last d of its token_ids) is scored at
        # its last d+1 rows: the row before the first draft predicts it, each draft's row the
        # next, the last row the bonus token. Rejected drafts' KV stays in the cache past the
        # rolled-back num_computed_tokens: nothing attends to it, and the next step overwrites it.
        rows = [r for i, s in sampling for r in range(ends[i] - 1 - s.num_draft_tokens, ends[i])]
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
        if not self.samples:
            return {}
        out: dict[str, list[int]] = {}
        start = 0
        for _, s in sampling:
            d = s.num_draft_tokens
            drafts = list(s.token_ids[len(s.token_ids) - d :])
            out[s.request_id] = self.sampler.verify(logits[start : start + d + 1], s.request_id, s.sampling_params, drafts)
            start += d + 1
        return out
