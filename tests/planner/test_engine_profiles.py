"""Engine profiles load, cite a source for every value they set, and resolve the defaults the engines'
code documents on an H100 (hopper, 80 GiB), an A100 80GB (ampere) and an L40S (ada, 48 GiB)."""

from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from engine.config import ENGINE_DEFAULTS, EngineKnobs, graph_capture_sizes
from engine.errors import InputError
from planner.engines import (ENGINE_FLAG_KNOBS, PROFILE_DIR, engine_catalog, engine_for_release, get_engine, knobs_from_flags,
                             load_engine_profile, resolve_deployment)
from planner.engines.docs import DOC, regenerate
from planner.hardware import get_hardware
from planner.specs import Deployment

REPO = Path(__file__).resolve().parents[2]
PROFILES = ["vllm-0.5", "vllm-0.6", "vllm-0.9", "vllm-0.11", "sglang-0.3", "sglang-0.4", "sglang-0.5", "trtllm-1.2",
            "serveplan"]
# nvidia-smi's memory.total, which SGLang reads (MiB), as GiB
H100_SMI_GIB, L40S_SMI_GIB = 81559 / 1024, 46068 / 1024


def _device(name: str) -> tuple[str, float]:
    hw = get_hardware(name)
    return hw.family, hw.memory_gib


H100, A100, L40S = _device("h100-sxm"), _device("a100-80gb-sxm"), _device("l40s")


def test_catalog_holds_every_release_line() -> None:
    assert sorted(engine_catalog()) == sorted(PROFILES)
    assert get_engine("vllm-0.11").engine == "vllm"


def _is_citable(source: str) -> bool:
    """A URL, or a file of this repository (ServePlan's own engine)."""
    return source.startswith("https://") or (REPO / source.split("#")[0]).is_file()


@pytest.mark.parametrize("name", PROFILES)
def test_every_set_value_has_a_source(name: str) -> None:
    raw = yaml.safe_load((PROFILE_DIR / f"{name}.yaml").read_text())
    profile = get_engine(name)
    for section in ("scheduling", "execution", "memory"):
        spec = getattr(profile, section)
        assert spec.sources and all(_is_citable(s) for s in spec.sources), f"{name}: {section}.sources"
        for field in set(raw[section]) - {"sources", "field_sources"}:
            value = getattr(spec, field)
            rules = value if field == "device_defaults" else [value] if hasattr(value, "source") else []
            if rules:  # a rule carries its own source
                assert all(_is_citable(rule.source) for rule in rules), f"{name}: {section}.{field}"
            else:
                assert field in spec.field_sources, f"{name}: {section}.{field} has no source"
    assert len(profile.overheads.provenance) > 40, f"{name}: overheads need their provenance"
    assert all(_is_citable(e.source) for e in profile.earlier_releases), f"{name}: earlier_releases"


def test_an_older_release_may_only_change_execution_settings(tmp_path: Path) -> None:
    raw = yaml.safe_load((PROFILE_DIR / "vllm-0.11.yaml").read_text())
    raw["earlier_releases"][0]["execution"] = {"graph_speedup": True}
    (tmp_path / "x.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(InputError, match="earlier_releases.0.*not execution settings: graph_speedup"):
        load_engine_profile(tmp_path / "x.yaml")


@pytest.mark.parametrize("name", ["vllm-0.9", "vllm-0.11"])
def test_vllm_v1_budgets_by_device(name: str) -> None:
    p = get_engine(name)
    assert p.scheduling_defaults(*H100) == (1024, 8192)
    assert p.scheduling_defaults(*H100, offline=True) == (1024, 16384)
    assert p.scheduling_defaults(*A100) == (256, 2048)  # >= 70 GiB but an A100 (PR #17885)
    assert p.scheduling_defaults(*A100, offline=True) == (256, 8192)
    assert p.scheduling_defaults(*L40S) == (256, 2048)
    assert p.max_graph_batch_size(*H100) == 512
    assert p.chunked_prefill_default() and p.batching_default() == "mixed"


@pytest.mark.parametrize("name", ["vllm-0.5", "vllm-0.6"])
def test_vllm_v0_budget_follows_max_model_len(name: str) -> None:
    p = get_engine(name)
    for device in (H100, A100, L40S):
        assert p.scheduling_defaults(*device, max_model_len=1024) == (256, 2048)
        assert p.scheduling_defaults(*device, max_model_len=8192) == (256, 8192)
        assert p.scheduling_defaults(*device, max_model_len=32768) == (256, 32768)
        # Above 32k, chunked prefill switches itself on with its own small budget.
        assert p.scheduling_defaults(*device, max_model_len=131072) == (256, 512)
    assert not p.chunked_prefill_default(32768) and p.batching_default(32768) == "prefill_first"
    assert p.chunked_prefill_default(32769) and p.batching_default(131072) == "mixed"
    with pytest.raises(InputError, match="max_model_len"):
        p.scheduling_defaults(*H100)


@pytest.mark.parametrize("name", ["vllm-0.5", "vllm-0.6"])
def test_vllm_v0_chunked_prefill_flag_decides_budget_and_batching(name: str) -> None:
    """--enable-chunked-prefill given either way wins over the long-context switch: off, a long model's
    budget covers its max_model_len and prefills run first (a published 405B run sets it off with 1,024
    running requests, which the switch's 512-token budget could not decode in one step); on, a short
    model takes the chunked budget and mixed steps."""
    p = get_engine(name)
    assert p.scheduling_defaults(*H100, max_model_len=131072, chunked_prefill=False) == (256, 131072)
    assert p.batching_default(131072, chunked_prefill=False) == "prefill_first"
    assert p.scheduling_defaults(*H100, max_model_len=4096, chunked_prefill=True) == (256, 512)
    assert p.batching_default(4096, chunked_prefill=True) == "mixed"
    long_off = Deployment(hardware="h100-sxm", engine=name, knobs=EngineKnobs(enable_chunked_prefill=False,
                                                                              max_num_seqs=1024))
    knobs = resolve_deployment(long_off, get_hardware("h100-sxm"), max_model_len=131072).knobs
    assert (knobs.max_num_batched_tokens, knobs.batching) == (131072, "prefill_first")


def test_sglang_05_chunk_graph_and_memory_fraction_by_device() -> None:
    p = get_engine("sglang-0.5")
    assert p.scheduling_defaults(*H100) == (4096, 8192) and p.max_graph_batch_size(*H100) == 256
    assert p.scheduling_defaults(*A100) == (4096, 8192) and p.max_graph_batch_size(*A100) == 256
    assert p.scheduling_defaults(*L40S) == (4096, 4096) and p.max_graph_batch_size(*L40S) == 32
    assert p.max_graph_batch_size(*H100, tp=8) == 512 and p.max_graph_batch_size(*L40S, tp=4) == 160
    assert p.scheduling_defaults("blackwell", 180) == (4096, 16384) and p.max_graph_batch_size("blackwell", 180) == 512
    assert p.scheduling_defaults("ada", 24) == (4096, 2048) and p.max_graph_batch_size("ada", 24) == 24
    # Hand-computed from server_args: reserved = 512 + 1.5 x chunk + 2 x graph bs + 128 x TP (MiB).
    assert p.memory_utilization("hopper", H100_SMI_GIB) == 0.835  # (81559 - 13440) / 81559
    assert p.memory_utilization("hopper", H100_SMI_GIB, tp=8) == 0.818  # (81559 - 14848) / 81559
    assert p.memory_utilization("ada", L40S_SMI_GIB) == 0.851  # (46068 - 6848) / 46068, no 10 GiB floor
    # Below 60 GiB no 10 GiB floor: 512 + 1.5 x 2048 + 2 x 8 + 128 = 3728 MiB.
    assert p.memory_utilization("ada", 16) == 0.772  # (16384 - 3728) / 16384


def test_sglang_04_chunk_graph_and_memory_fraction_by_device_and_tp() -> None:
    p = get_engine("sglang-0.4")
    # 25,000 MiB as nvidia-smi reports it is the line: above, chunk 8192 and graphs to 160; below, 2048 and 8.
    for device in (H100, A100, L40S, ("ada", 25_000 / 1024)):
        assert p.scheduling_defaults(*device) == (4096, 8192) and p.max_graph_batch_size(*device) == 160
    assert p.scheduling_defaults("ada", 24_999 / 1024) == (4096, 2048) and p.max_graph_batch_size("ada", 24) == 8
    assert [p.memory_utilization(*H100, tp=tp) for tp in (1, 2, 4, 8, 16)] == [0.88, 0.87, 0.85, 0.81, 0.79]
    assert p.execution.overlap_host and p.execution.graph_batch_sizes[-1] == 160


@pytest.mark.parametrize(("version", "line"), [("0.3.0", "sglang-0.3"), ("0.3.5.post2", "sglang-0.3"),
                                               ("0.3.6", "sglang-0.4"), ("0.3.6.post3", "sglang-0.4"),
                                               ("0.4.0.post1", "sglang-0.4"), ("0.4.10", "sglang-0.4"),
                                               ("0.5.3rc0", "sglang-0.5"), ("0.5.5.post1", "sglang-0.5")])
def test_each_sglang_release_picks_the_line_whose_defaults_it_has(version: str, line: str) -> None:
    # 0.3.6 turned the overlap scheduler on: it runs as 0.4.0 does, not as 0.3.0.
    assert engine_for_release("sglang", version) == (f"{line}@{version}", None)


def test_a_named_release_runs_with_its_lines_older_execution() -> None:
    # vLLM 0.10.x replayed decode steps as piecewise graphs; 0.11.0 made whole decode graphs the default.
    line = get_engine("vllm-0.11")
    older, current = get_engine("vllm-0.11@0.10.1.1"), get_engine("vllm-0.11@0.11.0")
    assert older.execution.piecewise_decode_graphs and not current.execution.piecewise_decode_graphs
    assert not line.execution.piecewise_decode_graphs
    # Only that setting differs, and the release keeps the line's name (the public fit's figures are the line's).
    assert older.model_copy(update={"execution": line.execution}) == line and older.name == "vllm-0.11"
    assert engine_for_release("vllm", "0.10.2") == ("vllm-0.11@0.10.2", None)
    assert Deployment(hardware="h100-sxm", engine="vllm-0.11@0.10.2").engine == "vllm-0.11@0.10.2"


@pytest.mark.parametrize(("name", "message"), [
    ("vllm-0.11@0.9.2", "engine release='0.9.2' is invalid: vllm-0.11 describes releases 0.10.0 to 0.11.99"),
    ("vllm-0.11@x", "engine release='x' is invalid: must be a version such as 0.10.2 (PEP 440)"),
    ("serveplan@1.0", "engine release='1.0' is invalid: serveplan is not a released engine: name no release"),
])
def test_a_release_outside_its_line_is_refused_by_name(name: str, message: str) -> None:
    with pytest.raises(InputError) as err:
        get_engine(name)
    assert str(err.value) == message


def test_sglang_running_cap_follows_the_kv_pool() -> None:
    p5, p3 = get_engine("sglang-0.5"), get_engine("sglang-0.3")
    # 450k KV tokens, 128k context: 450000 / 131072 x 512 = 1757 slots, raised to the 2048 floor.
    assert p5.max_running_requests(*H100, kv_tokens=450_000, context_len=131_072) == 2048
    assert p3.max_running_requests(*H100, kv_tokens=450_000, context_len=131_072) == 2047
    # A small pool: half the KV tokens.
    assert p5.max_running_requests(*H100, kv_tokens=3000, context_len=8192) == 1500
    # A large pool of short contexts hits the slot ceiling.
    assert p5.max_running_requests(*H100, kv_tokens=2_000_000, context_len=4096) == 4096
    assert p3.max_running_requests(*H100, kv_tokens=2_000_000, context_len=4096) == 5119
    assert get_engine("vllm-0.11").max_running_requests(*A100, kv_tokens=10, context_len=8192) == 256


def test_sglang_03_and_trtllm_ignore_the_device() -> None:
    p3, trt = get_engine("sglang-0.3"), get_engine("trtllm-1.2")
    for device in (H100, A100, L40S):
        assert p3.scheduling_defaults(*device) == (5119, 8192)
        assert trt.scheduling_defaults(*device) == (2048, 8192)
    assert [p3.memory_utilization(*H100, tp=tp) for tp in (1, 2, 4, 8, 16)] == [0.88, 0.87, 0.85, 0.83, 0.79]
    assert trt.memory_utilization(*H100) == 0.9 and trt.memory.utilization_of == "free_after_weights"
    assert trt.scheduling.admission == "reserve_output" and trt.scheduling.preemption == "none"
    assert not trt.execution.graph_padding and trt.max_graph_batch_size(*H100) == 128


def test_serveplan_profile_matches_the_engine_knobs() -> None:
    """The profile of ServePlan's engine is the engine's own defaults, so it cannot drift from them."""
    p = get_engine("serveplan")
    stated = p.knob_defaults(*H100, max_model_len=8192)
    assert replace(stated, max_graph_batch_size=ENGINE_DEFAULTS.max_graph_batch_size) == ENGINE_DEFAULTS
    assert p.execution.cuda_graphs == (not EngineKnobs().enforce_eager)
    largest = min(ENGINE_DEFAULTS.max_graph_batch_size, ENGINE_DEFAULTS.max_num_seqs)  # what LLM captures
    assert p.execution.max_graph_batch_size == largest == graph_capture_sizes(largest)[-1]


def test_knobs_hand_out_the_engines_choices_only_once_all_are_set() -> None:
    """A knob set by the deployment wins over the engine's default; one left unset is named, not read as None."""
    knobs = EngineKnobs(max_num_seqs=4).with_defaults(get_engine("vllm-0.11").knob_defaults(*H100))
    assert knobs.choices.max_num_seqs == 4 and knobs.choices.max_num_batched_tokens == 8192
    with pytest.raises(InputError, match="block_size_tokens.*max_graph_batch_size.*defaults first"):
        EngineKnobs(max_num_seqs=4).choices


def _write(tmp_path: Path, name: str, change) -> Path:
    data = yaml.safe_load((PROFILE_DIR / f"{name}.yaml").read_text())
    change(data)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(("name", "change", "where"), [
    ("vllm-0.11", lambda d: d["scheduling"].update(admission_ratio_min=0.1), "scheduling"),
    ("vllm-0.11", lambda d: d["scheduling"]["field_sources"].update(max_seqs="https://x"), "scheduling"),
    ("vllm-0.11", lambda d: d["memory"]["field_sources"].update(utilization_of="https://not-listed"), "memory"),
    ("sglang-0.5", lambda d: d["scheduling"].update(max_num_seqs=1000), "scheduling"),
    ("trtllm-1.2", lambda d: d["execution"].update(graph_batch_sizes=[1, 2, 64]), "execution"),
    ("sglang-0.3", lambda d: d["memory"].update(utilization_by_tp=[{"min_tp": 1, "utilization": 0.88},
                                                                  {"min_tp": 8, "utilization": 0.83}]), "memory"),
])
def test_inconsistent_profiles_are_rejected_naming_the_place(tmp_path: Path, name: str, change, where: str) -> None:
    with pytest.raises(InputError, match=rf"{name}\.yaml at {where}"):
        load_engine_profile(_write(tmp_path, name, change))


def test_the_docs_tables_are_generated_from_the_profiles() -> None:
    text = DOC.read_text()
    assert regenerate(text) == text, "run: python -m planner.engines.docs"
    for name in PROFILES:
        assert f"<!-- profile: {name} -->" in text


def test_each_engines_launch_flags_set_the_knob_they_name() -> None:
    """vLLM's, SGLang's and TensorRT-LLM's names for one knob land on it; flags that set no knob
    (a backend, a dtype) are left out; every mapped name is a knob."""
    assert knobs_from_flags({"gpu_memory_utilization": 0.25, "max_num_seqs": 64, "block_size": 32}) == EngineKnobs(
        gpu_memory_utilization=0.25, max_num_seqs=64, block_size_tokens=32)
    assert knobs_from_flags({"mem_fraction_static": 0.8, "chunked_prefill_size": 4096, "max_running_requests": 128,
                             "cuda_graph_max_bs": 8, "attention_backend": "fa3"}) == EngineKnobs(
        gpu_memory_utilization=0.8, max_num_batched_tokens=4096, max_num_seqs=128, max_graph_batch_size=8)
    assert knobs_from_flags({"free_gpu_memory_fraction": 0.9, "max_num_tokens": 8192, "max_batch_size": 256}) == EngineKnobs(
        gpu_memory_utilization=0.9, max_num_batched_tokens=8192, max_num_seqs=256)
    assert set(ENGINE_FLAG_KNOBS.values()) <= set(EngineKnobs.model_fields)
