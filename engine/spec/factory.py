"""Build the proposer an engine's SpeculativeSettings ask for, refusing settings that cannot work."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import ModelConfig, SpeculativeSettings
from engine.errors import InputError
from engine.model.decoder import CausalLM
from engine.model.loader import load_model
from engine.core.speculative import Proposer
from engine.spec.draft import DraftModelProposer
from engine.spec.early_exit import EarlyExitDraft
from engine.spec.ngram import NgramProposer


@dataclass(frozen=True)
class TargetInfo:
    """What the proposers need to know of the target engine."""

    model: CausalLM
    config: ModelConfig
    tokenizer: object  # a transformers tokenizer, or None
    max_model_len: int
    num_blocks: int  # the target's KV blocks: the draft cache gets as many, plus room for drafts
    block_size: int
    max_num_seqs: int
    kv_dtype: torch.dtype
    dtype: torch.dtype
    device: torch.device
    seed: int
    random_weights: bool


def build_proposer(spec: SpeculativeSettings, target: TargetInfo) -> Proposer:
    k = spec.num_speculative_tokens
    # A request holds at least one prompt token and samples at least one token itself, so at
    # most max_model_len - 2 drafts can ever be verified in one step.
    if k > target.max_model_len - 2:
        raise InputError("speculative.num_speculative_tokens", k,
                         f"must be <= max_model_len - 2 = {target.max_model_len - 2}")
    if spec.method == "ngram":
        return NgramProposer(spec.ngram_min_n, spec.ngram_max_n)
    if spec.method == "self":
        n, total = spec.draft_layers, target.config.num_layers
        if n is None or not 1 <= n < total:
            raise InputError("speculative.draft_layers", n, f"must be in 1..{total - 1} (the target has {total} layers)")
        draft = EarlyExitDraft(target.model, n)
        return DraftModelProposer(draft, draft.config, _draft_blocks(target, k), target.block_size,
                                  target.kv_dtype, target.device)
    return _draft_model(spec, target)


def _draft_model(spec: SpeculativeSettings, target: TargetInfo) -> DraftModelProposer:
    assert spec.draft_model is not None  # SpeculativeSettings requires it for method='draft'
    loaded = load_model(spec.draft_model, dtype=target.dtype, device=target.device, seed=target.seed,
                        random_weights=target.random_weights)
    c, t = loaded.config, target.config
    if c.vocab_size != t.vocab_size:
        raise InputError("speculative.draft_model", spec.draft_model,
                         f"its vocab_size={c.vocab_size} differs from the target's {t.vocab_size}: "
                         "draft and target must share one tokenizer")
    if loaded.tokenizer is not None and target.tokenizer is not None:
        if loaded.tokenizer.get_vocab() != target.tokenizer.get_vocab():  # type: ignore[attr-defined]
            raise InputError("speculative.draft_model", spec.draft_model,
                             "its tokenizer maps tokens to other ids than the target's: they must share one tokenizer")
    if c.max_position_embeddings < target.max_model_len:
        raise InputError("speculative.draft_model", spec.draft_model,
                         f"its context of {c.max_position_embeddings} tokens is shorter than max_model_len={target.max_model_len}")
    return DraftModelProposer(loaded.model, c, _draft_blocks(target, spec.num_speculative_tokens), target.block_size,
                              target.kv_dtype, target.device)


def _draft_blocks(target: TargetInfo, k: int) -> int:
    # The target's cache holds every running request's context; each request's draft positions
    # (k - 1 fed drafts) may need up to ceil(k / block_size) + 1 blocks beyond it.
    return target.num_blocks + target.max_num_seqs * (-(-k // target.block_size) + 1)
