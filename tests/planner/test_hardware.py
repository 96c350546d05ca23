"""Every hardware profile loads and says where its derived figures come from."""

import pytest

from engine.errors import InputError
from planner.hardware import get_hardware, hardware_catalog, load_profile_file

REQUIRED = [
    "h100-sxm", "h100-pcie", "h100-nvl", "h200", "b200", "gb200", "b300", "a100-40gb-sxm", "a100-80gb-sxm",
    "a100-40gb-pcie", "a100-80gb-pcie", "l40s", "l4", "a10g", "rtx-4090", "rtx-5090", "mi300x", "mi325x",
    "mi355x", "gaudi2", "gaudi3", "tpu-v5e", "tpu-v5p", "tpu-v6e", "dgx-spark", "m4-max", "m3-ultra",
    "epyc-9654-2s", "xeon-8480-2s",
]


def test_catalog_holds_the_required_profiles() -> None:
    assert set(REQUIRED) <= set(hardware_catalog())
    assert len(hardware_catalog()) >= 24


@pytest.mark.parametrize("name", REQUIRED)
def test_profile_is_consistent(name: str) -> None:
    p = get_hardware(name)
    assert p.memory_gib > 0 and p.memory_bandwidth_gb_s > 0 and p.sources
    # A device's FP8 peak is never below its BF16 peak; ridge point in a plausible range.
    if p.peak_tflops.fp8 and p.peak_tflops.bf16:
        assert p.peak_tflops.fp8 >= p.peak_tflops.bf16
    for field in p.provenance:
        head = field.split(".")[0]
        assert head in type(p).model_fields, f"provenance names unknown field {field}"


def test_sparse_datasheet_figures_are_marked() -> None:
    assert "peak_tflops.bf16" in get_hardware("h100-pcie").provenance


def test_unknown_hardware_suggests_close_names() -> None:
    with pytest.raises(InputError, match="did you mean.*h100-sxm"):
        get_hardware("h100-sx")


def test_malformed_yaml_is_an_input_error(tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(InputError, match="malformed YAML"):
        load_profile_file(bad)


def test_invalid_field_is_named(tmp_path) -> None:
    import yaml

    data = get_hardware("h100-sxm").model_dump(mode="json")
    data["memory_bandwidth_gb_s"] = -1
    path = tmp_path / "neg.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(InputError, match="memory_bandwidth_gb_s"):
        get_hardware(str(path))


# --------------------------------------------------------------------------- issue 14, defect 11
# A profile's figures are finite and within sane bounds (planner/specs.py), so a typo cannot turn
# into 0 ms or 1e300 s latencies or a free GPU.


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (("memory_bandwidth_gb_s",), float("inf"), "finite number"),
        (("memory_bandwidth_gb_s",), 1e-300, "greater than or equal to 0.1"),
        (("memory_gib",), float("inf"), "finite number"),
        (("memory_gib",), 0, "greater than or equal to 0.25"),
        (("peak_tflops", "bf16"), 1e300, "less than or equal to 1000000"),
        (("price_usd_per_hour",), 1e9, "less than or equal to 1000"),
        (("scale_up", "latency_us"), float("nan"), "finite number"),
        (("efficiency", "step_overhead_us"), 1e12, "less than or equal to"),
        (("peak_tflops",), {}, "at least one numeric format needs a peak"),
    ],
)
def test_absurd_profile_figures_are_refused(tmp_path, path: tuple[str, ...], value: object, message: str) -> None:
    import yaml

    data = get_hardware("h100-sxm").model_dump(mode="json")
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    file = tmp_path / "p.yaml"
    file.write_text(yaml.safe_dump(data))
    with pytest.raises(InputError) as info:
        load_profile_file(file)
    assert info.value.field.startswith(f"p.yaml: {'.'.join(path)}") and message in info.value.allowed, info.value
