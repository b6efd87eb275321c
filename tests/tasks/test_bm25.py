"""BM25 scores checked against numbers worked out by hand, and the tokenizer."""

from __future__ import annotations

import math

import pytest

from tasks.bm25 import BM25, tokenize

# d0 = [apple, banana] (length 2), d1 = [apple, apple, cherry] (length 3); avgdl = 2.5, k1 = 1.5, b = 0.75.
# norm(d0) = 1.5 * (0.25 + 0.75 * 2 / 2.5) = 1.275; norm(d1) = 1.5 * (0.25 + 0.75 * 3 / 2.5) = 1.725
# idf(banana) = ln((2 - 1 + 0.5) / (1 + 0.5) + 1) = ln 2; idf(apple) = ln(0.5 / 2.5 + 1) = ln 1.2
DOCS = ["Apple, banana.", "apple APPLE cherry"]


@pytest.mark.parametrize(
    "query,expected",
    [
        ("banana", [math.log(2) * 2.5 / (1 + 1.275), 0.0]),
        ("apple", [math.log(1.2) * 2.5 / (1 + 1.275), math.log(1.2) * 2 * 2.5 / (2 + 1.725)]),
        ("the banana of", [math.log(2) * 2.5 / (1 + 1.275), 0.0]),  # stopwords add nothing
        ("durian", [0.0, 0.0]),
    ],
)
def test_scores_match_hand_computed_values(query: str, expected: list[float]) -> None:
    assert BM25(DOCS).scores(query) == pytest.approx(expected)


def test_top_k_ranks_drops_zero_scores_and_breaks_ties_by_position() -> None:
    index = BM25(DOCS + ["banana split"])
    assert [i for i, _ in index.top_k("apple", 5)] == [1, 0]
    assert [i for i, _ in index.top_k("apple banana", 1)] == [0]
    assert index.top_k("durian", 3) == []
    tie = BM25(["kiwi", "kiwi"]).top_k("kiwi", 2)
    assert [i for i, _ in tie] == [0, 1] and tie[0][1] == tie[1][1] > 0


@pytest.mark.parametrize(
    "text,tokens",
    [
        ("What is the Zabeist-500?", ["zabeist", "500"]),
        ("  Who founded Vobourv Labs?\n", ["founded", "vobourv", "labs"]),
        ("", []),
        ("Café №7", ["caf", "7"]),  # only ASCII letters and digits make tokens
    ],
)
def test_tokenize(text: str, tokens: list[str]) -> None:
    assert tokenize(text) == tokens
