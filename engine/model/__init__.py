"""The PyTorch model: a Llama-family decoder over a paged KV cache, and its loader."""

from engine.model.decoder import CausalLM
from engine.model.loader import LoadedModel, load_model

__all__ = ["CausalLM", "LoadedModel", "load_model"]
