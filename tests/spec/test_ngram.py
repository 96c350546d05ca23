"""Prompt lookup: the longest recurring suffix n-gram first, its latest earlier occurrence, up to k tokens."""

import pytest

from engine.core import Request, SamplingParams
from engine.errors import InputError
from engine.spec import NgramProposer


@pytest.mark.parametrize(("tokens", "k", "expected"), [
    ([1, 2, 3, 9, 1, 2, 3], 2, [9, 1]),  # "1 2 3" recurs: what followed it
    ([1, 2, 3, 4, 5, 7, 2, 3], 3, [4, 5, 7]),  # "2 3" (n=2) found although "7 2 3" is not
    ([1, 2, 8, 1, 2, 9, 1, 2], 1, [9]),  # the latest occurrence wins
    ([1, 2, 3, 4], 2, []),  # nothing recurs
    ([5, 5, 5], 4, [5]),  # overlapping match; only one token follows it
    ([7, 1, 2, 3], 2, []),  # min_n=2: a lone repeated token is not enough
])
def test_lookup(tokens: list[int], k: int, expected: list[int]) -> None:
    assert NgramProposer(min_n=2, max_n=3).lookup(tokens, k) == expected


def test_propose_leaves_out_requests_without_a_match() -> None:
    params = SamplingParams(max_tokens=8)
    hit = Request("hit", [4, 5, 6, 4, 5], params, 0.0)
    miss = Request("miss", [1, 2, 3], params, 0.0)
    assert NgramProposer(1, 2).propose([hit, miss], [3, 3]) == {"hit": [6, 4, 5]}


def test_bad_n_range() -> None:
    with pytest.raises(InputError, match="ngram_min_n=3 is invalid"):
        NgramProposer(3, 2)
