"""The published GPU measurements and engine start-up logs the GPU fidelity work is fitted to and checked against
(planner/data/*.json): they load through the schema, name only known models and GPUs, keep the sources reserved for
the independent check out, and each benchmark run is described once and consistently."""

from __future__ import annotations

from collections import defaultdict

import pytest

from engine.catalog import catalog, resolve_model
from planner.hardware import get_hardware
from planner.public.data import is_reserved, public_runs, startup_logs

RUNS = public_runs()
FIGURES = [f for run in RUNS for f in run.figures]
LOGS = startup_logs()


def test_files_load_through_the_schema_with_the_promised_coverage() -> None:
    # The floors are what the files hold today: data may grow, never silently shrink.
    assert len(FIGURES) >= 3192
    assert len({run.source_key for run in RUNS}) >= 21
    assert len(RUNS) >= 336
    assert len(LOGS) >= 25
    assert len({log.source_key for log in LOGS}) >= 6


@pytest.mark.parametrize("ids", [[f.id for f in FIGURES], [run.run_key for run in RUNS], [log.id for log in LOGS]],
                         ids=["figures", "runs", "startup_logs"])
def test_ids_are_unique(ids) -> None:
    assert len(ids) == len(set(ids)), sorted(i for i in set(ids) if ids.count(i) > 1)


@pytest.mark.parametrize("entries", [RUNS, LOGS], ids=["runs", "startup_logs"])
def test_every_model_and_gpu_resolves(entries) -> None:
    for name in sorted({e.deployment.model for e in entries}):
        resolve_model(name)
    for name in sorted({e.deployment.hardware for e in entries}):
        get_hardware(name)


@pytest.mark.parametrize("entries", [RUNS, LOGS], ids=["runs", "startup_logs"])
def test_no_reserved_source_is_used(entries) -> None:
    urls = [e.source_url for e in entries] + [f.source_url for f in FIGURES if f.source_url]
    assert not [url for url in urls if is_reserved(url)]
    # The guard recognises what it guards (a made-up URL under a reserved host).
    assert is_reserved("https://" + "perf." + "vllm.ai/some/page")


@pytest.mark.parametrize("entries", [RUNS, LOGS], ids=["runs", "startup_logs"])
def test_gpu_count_is_the_product_of_the_parallel_sizes(entries) -> None:
    for e in entries:
        d = e.deployment
        assert d.num_gpus == d.tensor_parallel * d.pipeline_parallel * d.data_parallel, e


def test_random_lengths_agree_with_each_clients_sampling() -> None:
    """Where totals were published, the mean random prompt follows the client's --random-range-ratio semantics:
    vLLM's default draws the nominal length, SGLang's draws uniformly below it; no output exceeds its nominal."""
    for m in RUNS:
        lengths = m.lengths
        if lengths.dataset != "random" or lengths.mean_input_tokens is None:
            continue
        ratio = lengths.mean_input_tokens / lengths.input_tokens
        if m.client.tool == "vllm-bench-serve" and lengths.random_range_ratio == 0:
            assert 0.97 < ratio < 1.03, m.run_key
        if m.client.tool == "sglang-bench-serving" and lengths.random_range_ratio == 0:
            assert 0.4 < ratio < 0.6, m.run_key
        assert lengths.mean_output_tokens <= lengths.output_tokens * 1.001, m.run_key


def test_startup_reports_are_internally_consistent() -> None:
    for log in LOGS:
        r = log.reported
        if r.weights_gib is not None and r.total_gpu_memory_gib is not None:
            assert r.weights_gib < r.total_gpu_memory_gib, log.id
        if r.free_gpu_memory_gib is not None:
            assert r.free_gpu_memory_gib <= r.total_gpu_memory_gib, log.id
        # vLLM's token count is its KV bytes divided by the model's bytes per token: a positive cache holds tokens.
        if r.kv_cache_tokens is not None:
            assert r.kv_cache_gib is not None and r.kv_cache_gib > 0, log.id


# Published totals of the models added to the catalog with this data (billions of parameters).
NEW_CATALOG_MODELS = {
    "qwen3-14b": (14.8, "https://huggingface.co/Qwen/Qwen3-14B model card: Number of Parameters 14.8B"),
    "qwen3-0.6b": (0.6, "https://huggingface.co/Qwen/Qwen3-0.6B model card: Number of Parameters 0.6B"),
}


@pytest.mark.parametrize("name", sorted(NEW_CATALOG_MODELS))
def test_new_catalog_models_match_their_published_size(name: str) -> None:
    published_b, _source = NEW_CATALOG_MODELS[name]
    assert resolve_model(name).total_params / 1e9 == pytest.approx(published_b, rel=0.02)
    assert catalog()[name].published_total_params_b == published_b
