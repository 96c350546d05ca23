"""Speculative decoding's proposers and verification (the torch-free bookkeeping, `draft_budget`,
`Proposer` and `SpecStats`, lives in engine/core/speculative.py, shared with the simulator).

Only the n-gram proposer is re-exported: `engine.spec.draft` (draft-model and self-speculative
proposers), `engine.spec.verify` (greedy and rejection-sampling verification) and
`engine.spec.factory` need torch and are imported from their modules.
"""

from engine.spec.ngram import NgramProposer

__all__ = ["NgramProposer"]
