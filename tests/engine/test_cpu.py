"""The engine's default thread count (engine/cpu.py) and the --threads flag every engine command takes."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import cpu


def fake_sysfs(root: Path, cores: dict[int, tuple[int, int]]) -> Path:
    """/sys/devices/system/cpu with cpuN -> (package, core)."""
    for n, (package, core) in cores.items():
        topology = root / f"cpu{n}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text(f"{package}\n")
        (topology / "core_id").write_text(f"{core}\n")
    return root


def test_hyper_thread_siblings_count_once_and_only_cpus_of_the_affinity_mask(tmp_path, monkeypatch) -> None:
    # 2 packages x 2 cores x 2 threads; this process may run on 6 of the 8 CPUs.
    sysfs = fake_sysfs(tmp_path, {n: (n // 4, (n // 2) % 2) for n in range(8)})
    monkeypatch.setattr(cpu, "SYS_CPU", sysfs)
    monkeypatch.setattr(cpu, "CGROUP_CPU_MAX", tmp_path / "no-cgroup")
    monkeypatch.setattr(cpu.os, "sched_getaffinity", lambda pid: {0, 1, 2, 4, 5, 6})
    assert cpu.physical_cores() == 4  # cores (0,0) (0,1) (1,0) (1,1); 1 and 5 are siblings of 0 and 4


def test_a_cgroup_quota_caps_the_count(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(cpu, "SYS_CPU", fake_sysfs(tmp_path / "sys", {n: (0, n) for n in range(8)}))
    monkeypatch.setattr(cpu.os, "sched_getaffinity", lambda pid: set(range(8)))
    quota = tmp_path / "cpu.max"
    monkeypatch.setattr(cpu, "CGROUP_CPU_MAX", quota)
    quota.write_text("250000 100000\n")  # 2.5 CPUs of time
    assert cpu.physical_cores() == 3
    quota.write_text("max 100000\n")
    assert cpu.physical_cores() == 8


def test_unreadable_topology_counts_every_cpu_of_the_mask(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(cpu, "SYS_CPU", tmp_path / "missing")
    monkeypatch.setattr(cpu, "CGROUP_CPU_MAX", tmp_path / "missing-too")
    monkeypatch.setattr(cpu.os, "sched_getaffinity", lambda pid: {0, 3})
    assert cpu.physical_cores() == 2


@pytest.mark.parametrize(("env", "expected"), [("3", 3), ("0", None), ("many", None), ("", None)])
def test_omp_num_threads_wins_when_it_is_a_positive_count(monkeypatch, env: str, expected: int | None) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", env)
    monkeypatch.setattr(cpu, "physical_cores", lambda: 5)
    assert cpu.default_threads() == (expected or 5)


def test_engine_commands_set_the_threads_they_are_given(tiny_model, capsys) -> None:
    import os

    import torch

    from planner.cli import main

    threads = min(2, os.cpu_count() or 1)  # the conftest left 1
    model = tiny_model("tiny-vocab", vocab_size=4096)  # the presets draw token ids from 1000 up
    code = main(["engine", "bench", "--model", str(model), "--random-weights", "--workload", "chat",
                 "--requests", "1", "--input-tokens", "4", "--output-tokens", "2", "--threads", str(threads), "--json"])
    assert code == 0 and torch.get_num_threads() == threads, capsys.readouterr().err
    assert f"{threads} threads" in capsys.readouterr().out  # the summary says what it ran with


@pytest.mark.parametrize("tied", [False, True])
def test_fp32_matmul_weights_run_column_major_with_the_same_values(tiny_model, tied: bool) -> None:
    """The engine stores every fp32 CPU matmul weight column-major (engine/model/layers.py
    lay_out_cpu_matmul_weights): same shapes and values as loaded, strides (1, out). The embedding
    table stays row-major unless it is the LM head's weight too."""
    import torch

    from engine.llm import LLM
    from engine.model.loader import load_model

    folder = tiny_model(tie_word_embeddings=tied)
    loaded = load_model(str(folder), random_weights=True, seed=3)
    llm = LLM(str(folder), random_weights=True, seed=3, num_kv_blocks=8)
    model = llm.runner.model
    matrices = {name: p for name, p in model.named_parameters() if p.dim() == 2}
    assert matrices.keys() == {name for name, p in loaded.model.named_parameters() if p.dim() == 2}
    for name, weight in matrices.items():
        assert torch.equal(weight, dict(loaded.model.named_parameters())[name]), name
        table = name == "model.embed_tokens.weight" and not tied
        assert weight.is_contiguous() == table, name
        if not table:
            assert weight.stride() == (1, weight.shape[0]), name
