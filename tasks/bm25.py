"""Okapi BM25 over a small in-memory corpus, in pure Python.

The knowledge bases here are tens to thousands of documents, so a dict of term
frequencies per document is fast enough and keeps the tasks free of search
libraries. Scoring follows Robertson & Zaragoza, "The Probabilistic Relevance
Framework: BM25 and Beyond" (2009), with Lucene's non-negative idf
(https://lucene.apache.org/core/9_0_0/core/org/apache/lucene/search/similarities/BM25Similarity.html).
"""

from __future__ import annotations

import math
import re
from collections import Counter

TOKEN_RE = re.compile(r"[a-z0-9]+")

# Only words that carry no meaning in a question; a long list would drop
# words like "first" or "made" that the gold queries rely on.
STOPWORDS = frozenset(
    "a an and are as at be by did do does for from has have he her his how in is it its of on or "
    "she that the their them they this to was were what when where which who whom why with".split()
)


def tokenize(text: str) -> list[str]:
    """Lowercase alphanumeric runs, stopwords dropped."""
    return [t for t in TOKEN_RE.findall(text.lower()) if t not in STOPWORDS]


class BM25:
    """An index over `docs` (texts, in order); results are positions in that list."""

    def __init__(self, docs: list[str], k1: float = 1.5, b: float = 0.75) -> None:
        self.k1, self.b = k1, b
        self.term_freqs = [Counter(tokenize(d)) for d in docs]
        self.doc_lens = [sum(tf.values()) for tf in self.term_freqs]
        self.avgdl = sum(self.doc_lens) / len(docs) if docs else 0.0
        df: Counter[str] = Counter()
        for tf in self.term_freqs:
            df.update(tf.keys())
        n = len(docs)
        # Lucene's "+ 1" keeps idf positive for terms in more than half the documents.
        self.idf = {t: math.log((n - f + 0.5) / (f + 0.5) + 1.0) for t, f in df.items()}

    def scores(self, query: str) -> list[float]:
        """The BM25 score of every document for `query` (0.0 where no query term occurs)."""
        terms = tokenize(query)
        out = []
        for tf, dl in zip(self.term_freqs, self.doc_lens):
            norm = self.k1 * (1.0 - self.b + self.b * dl / self.avgdl)
            s = 0.0
            for t in terms:
                f = tf.get(t, 0)
                if f:
                    s += self.idf[t] * f * (self.k1 + 1.0) / (f + norm)
            out.append(s)
        return out

    def top_k(self, query: str, k: int) -> list[tuple[int, float]]:
        """The `k` best (position, score) pairs with a positive score, best first; ties keep corpus order."""
        ranked = sorted(enumerate(self.scores(query)), key=lambda p: (-p[1], p[0]))
        return [(i, s) for i, s in ranked[:k] if s > 0.0]
