"""Per-GPU memory as serving engines allocate it, cut by role: what the device reports (device), the
weights as loaded (weights), the profiling pass and the sampler (activations), the KV layout (kv),
and each engine's rule for the KV budget (engines), composed into one plan (plan).
"""

from planner.memory.activations import SAMPLERS
from planner.memory.kv import kv_bytes_per_token_per_layer_per_gpu
from planner.memory.parts import GIB
from planner.memory.plan import MemoryLine, MemoryPlan, WeightBreakdown, check_parallelism, plan_memory
from planner.memory.weights import (WEIGHT_BYTES_PER_PARAM, attention_params_per_rank, mxfp4_layout,
                                    quantises_experts_only)

# Logits and sampler temporaries per sampled row in the cost model's traffic, fp32 copies.
SAMPLER_COPIES = 3

__all__ = ["GIB", "SAMPLERS", "SAMPLER_COPIES", "WEIGHT_BYTES_PER_PARAM", "MemoryLine", "MemoryPlan", "WeightBreakdown",
           "attention_params_per_rank", "check_parallelism", "kv_bytes_per_token_per_layer_per_gpu", "mxfp4_layout",
           "plan_memory", "quantises_experts_only"]
