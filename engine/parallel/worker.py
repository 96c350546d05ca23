"""The process of one tensor-parallel rank: its shard of the model and the runners over it.

A rank loads the model as one process would, keeps its slice (engine/parallel/layers.py) and
then serves calls from the engine's process over a pipe: build a runner (one per engine over
these weights, as `LLM.with_settings` makes them), execute a step, forget finished requests,
report its communication time. Every rank runs the same SchedulerOutput through its own
ModelRunner, so block tables stay in step without further messages (vLLM V1's workers do the
same); only rank 0 samples. A reply is ("ok", result) or ("error", what went wrong), so the
engine's process never waits on a rank that has failed.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
import traceback
from typing import TYPE_CHECKING, Any

from engine.errors import InputError

if TYPE_CHECKING:
    import torch

    from engine.config import ModelConfig
    from engine.core import ExecutedStep, SchedulerOutput
    from engine.parallel.group import TPGroup
    from engine.runner import ModelRunner

# A rank that waits this long in one collective has lost its peer (gloo raises then).
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True)
class RankSpec:
    """What every rank needs to build its shard: the model source and the engine's settings."""

    model: str
    settings: dict[str, Any]  # EngineConfig.model_dump()
    world_size: int
    init_method: str  # a FileStore path every rank of this engine rendezvous at
    backend: str  # gloo (CPU) or nccl (CUDA)
    threads: int


@dataclass(frozen=True)
class ModelInfo:
    """What the engine's process needs of the model, sent once by rank 0."""

    config: ModelConfig
    tokenizer: Any
    source_description: str


class Worker:
    def __init__(self, spec: RankSpec, rank: int) -> None:
        import torch
        import torch.distributed as dist

        from engine.config import EngineConfig
        from engine.model.loader import load_model
        from engine.parallel.group import TPGroup
        from engine.parallel.layers import shard_model

        cfg = EngineConfig.model_validate(spec.settings)
        torch.set_num_threads(spec.threads)
        self.device = torch.device(f"cuda:{rank}" if spec.backend == "nccl" else "cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dist.init_process_group(spec.backend, init_method=spec.init_method, rank=rank, world_size=spec.world_size,
                                timeout=COLLECTIVE_TIMEOUT)
        loaded = load_model(spec.model, dtype=getattr(torch, cfg.dtype), device=self.device, seed=cfg.seed,
                            random_weights=cfg.random_weights)
        self.group: TPGroup = TPGroup(rank, spec.world_size, timed=self.device.type == "cpu")
        shard_model(loaded.model, self.group, expert_parallel=cfg.expert_parallel > 1)
        self.model, self.config = loaded.model, loaded.config
        self.info = ModelInfo(loaded.config, loaded.tokenizer, loaded.source_description) if rank == 0 else None
        self.runners: dict[int, ModelRunner] = {}

    def new_runner(self, runner_id: int, num_blocks: int, block_size: int, kv_dtype: torch.dtype, seed: int) -> None:
        from engine.parallel.layers import local_config
        from engine.runner import ModelRunner

        runner = ModelRunner(self.model, local_config(self.config, self.group.size), num_blocks, block_size, kv_dtype,
                             self.device, seed)
        runner.samples = self.group.rank == 0
        self.runners[runner_id] = runner

    def execute(self, runner_id: int, output: SchedulerOutput) -> ExecutedStep:
        return self.runners[runner_id].execute(output)

    def forget(self, runner_id: int, request_ids: list[str]) -> None:
        self.runners[runner_id].forget(request_ids)

    def drop_runner(self, runner_id: int) -> None:
        self.runners.pop(runner_id, None)

    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes of this rank's GPU after loading its shard."""
        import torch

        return torch.cuda.mem_get_info(self.device)

    def take_comm_stats(self) -> tuple[dict[str, float], dict[str, int]]:
        return self.group.take_stats()


def main(spec: RankSpec, rank: int, conn: Connection) -> None:
    """A rank's life: build the shard, report ready (rank 0 with the model's info), serve calls
    until told to stop or the engine's process goes away."""
    try:
        worker = Worker(spec, rank)
    except InputError as exc:
        conn.send(("error", exc))
        return
    except Exception:  # noqa: BLE001 (any failure is reported, not raised into a dead process)
        conn.send(("error", f"rank {rank} failed to start:\n{traceback.format_exc()}"))
        return
    conn.send(("ok", worker.info))
    while True:
        try:
            method, args = conn.recv()
        except EOFError:  # the engine's process has gone
            break
        if method == "shutdown":
            break
        try:
            conn.send(("ok", getattr(worker, method)(*args)))
        except Exception:  # noqa: BLE001
            conn.send(("error", f"rank {rank}, {method}:\n{traceback.format_exc()}"))
    import torch.distributed as dist

    dist.destroy_process_group()
