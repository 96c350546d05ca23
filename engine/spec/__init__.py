"""Speculative decoding: proposers that guess the next k tokens, and their verification.

Only the torch-free parts are re-exported here, because the simulator imports this package:
`engine.spec.draft` (draft-model and self-speculative proposers), `engine.spec.verify`
(greedy and rejection-sampling verification) and `engine.spec.factory` need torch and are
imported from their modules.
"""

from engine.spec.base import HeadProposer, Proposer, draft_budget
from engine.spec.ngram import NgramProposer
from engine.spec.stats import SpecStats

__all__ = ["HeadProposer", "NgramProposer", "Proposer", "SpecStats", "draft_budget"]
