"""Fuzzing what people write by hand (issue 14, defect 11): config.json dicts and hardware profile
dicts with fields replaced by hostile values (zero, negative, huge, non-finite, wrong types,
missing). Each is either refused with one InputError naming the field, or accepted as a model or
a profile whose derived figures are finite, positive and consistent: a typo never becomes an
absurd answer."""

from __future__ import annotations

import math

from hypothesis import given, settings, strategies as st
from pydantic import ValidationError

from engine.catalog import resolve_model
from engine.config import HFConfigFields, ModelConfig
from engine.errors import EXCERPT_CHARS, InputError, from_validation_error
from planner.costmodel import CostModel
from planner.hardware import get_hardware
from planner.memory import plan_memory
from planner.specs import Deployment, HardwareProfile

FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None)

HOSTILE = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, -1, 2, 3, 7, 2**31, 1e-300, 0.5, "32", "", "nan"]), st.text(max_size=12),
    st.lists(st.integers(-2, 40), max_size=3), st.dictionaries(st.sampled_from(["rope_type", "factor"]),
                                                                st.sampled_from(["yarn", 8, None]), max_size=2),
)


def assert_one_line(exc: InputError) -> None:
    text = str(exc)
    assert "\n" not in text and exc.field
    assert len(text.split(" is invalid: ")[0]) <= len(exc.field) + 1 + EXCERPT_CHARS


# --------------------------------------------------------------------------- config.json

BASES = {name: resolve_model(name).hf_config for name in
         ("llama-3.2-1b", "mixtral-8x7b", "deepseek-v3", "qwen3-30b-a3b", "gemma-2-9b", "gpt-oss-20b")}
CONFIG_FIELDS = sorted({*HFConfigFields.model_fields, "model_type", "text_config"})
H100 = get_hardware("h100-sxm")


@FUZZ
@given(base=st.sampled_from(sorted(BASES)), patch=st.dictionaries(st.sampled_from(CONFIG_FIELDS), HOSTILE,
                                                                  min_size=1, max_size=3),
       drop=st.lists(st.sampled_from(CONFIG_FIELDS), max_size=2))
def test_config_json(base: str, patch: dict, drop: list[str]) -> None:
    cfg = {**BASES[base], **patch}
    for key in drop:
        cfg.pop(key, None)
    try:
        model = ModelConfig.from_hf_config(cfg, name="fuzzed")
    except InputError as exc:
        assert_one_line(exc)
        return
    assert model.num_attention_heads % model.num_kv_heads == 0
    assert all(w is None or w >= 1 for w in model.layer_windows)
    assert not model.moe or 1 <= model.moe.top_k <= model.moe.num_experts
    for figure in (model.total_params, model.active_params, model.kv_bytes_per_token("bf16"),
                   model.flops_per_token(1024)):
        assert figure > 0 and math.isfinite(figure)
    try:
        plan = plan_memory(model, H100, Deployment(hardware="h100-sxm"), 1)
    except InputError as exc:  # e.g. context beyond the model's: refused, never absurd
        assert_one_line(exc)
        return
    assert math.isfinite(plan.weights.total_gib) and plan.weights.total_gib > 0


# --------------------------------------------------------------------------- hardware profiles

PROFILE = H100.model_dump(mode="json")
PROFILE_PATHS = [(k,) for k in PROFILE if k not in ("provenance", "sources")] + [
    ("peak_tflops", k) for k in PROFILE["peak_tflops"]] + [("scale_up", k) for k in PROFILE["scale_up"]] + [
    ("efficiency", k) for k in PROFILE["efficiency"]]
LLAMA = resolve_model("llama-3.2-1b")


@FUZZ
@given(changes=st.lists(st.tuples(st.sampled_from(PROFILE_PATHS), HOSTILE), min_size=1, max_size=3))
def test_hardware_profile(changes: list) -> None:
    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in PROFILE.items()}
    for path, value in changes:
        parent = data if len(path) == 1 else data.get(path[0])
        if isinstance(parent, dict):  # a section an earlier change replaced has no fields left
            parent[path[-1]] = value
    try:
        hw = HardwareProfile.model_validate(data)
    except ValidationError as exc:
        assert_one_line(from_validation_error(exc, "fuzzed.yaml"))
        return
    dep = Deployment(hardware=hw.name)
    try:
        cost = CostModel(LLAMA, hw, dep)
        memory = plan_memory(LLAMA, hw, dep, 4096)
    except InputError as exc:
        assert_one_line(exc)
        return
    for step in (cost.decode_cost(8, 1024), cost.prefill_cost(512)):
        # Bounded figures give bounded answers: no 0 ms and no 1e300 s steps.
        assert 1e-9 < step.seconds < 1e6, (step, changes)
    assert math.isfinite(memory.kv_cache_gib)
