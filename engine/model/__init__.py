"""The PyTorch model: a Llama-family decoder over a paged KV cache, and its loader."""

from engine.model.attention import AttentionMetadata, build_attention_metadata
from engine.model.decoder import CausalLM
from engine.model.loader import LoadedModel, load_model

__all__ = ["AttentionMetadata", "CausalLM", "LoadedModel", "build_attention_metadata", "load_model"]
