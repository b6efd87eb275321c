"""Generate the doc_search knowledge base: kb_docs.jsonl and kb_questions.jsonl, next to this file.

Run `python -m tasks.data.make_kb` from the repo root; the output is committed, and the same
script always writes the same bytes. Every entity is invented (names are random syllables), so a
model cannot answer from memory and must search. Each invented name is used once in the whole
corpus, so each question, which names its entity, is answerable from exactly one document; the
checks at the bottom make sure of it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from tasks.bm25 import BM25, STOPWORDS, tokenize

SEED = 7
N_PER_KIND = 15  # 4 kinds -> 60 documents
N_TEST = 30  # of 150 questions
OUT = Path(__file__).parent

ONSETS = "b br d dr f g gr h k kr l m n p qu r s sk t tr th v z".split()
VOWELS = "a e i o u ae ei ou".split()
CODAS = ["", "l", "n", "r", "x", "lt", "rn", "sk", "nd", "rv", "mb", "st"]

INDUSTRIES = ["weather balloon", "ceramic battery", "industrial kite", "glass lens", "bicycle gear", "water filter",
              "solar lantern", "ship rope", "clock spring", "paper lamp", "fountain pen", "greenhouse glass"]
COMPANY_SUFFIXES = ["Dynamics", "Works", "Labs", "Foundry", "Instruments", "Textiles", "Robotics", "Industries"]
TOWN_SUFFIXES = ["ford", "mere", "wick", "haven", "by", "stead", "holm", "dale"]
# product kind -> plausible weight range in grams
PRODUCT_KINDS = {"handheld radio": (180, 900), "folding bicycle": (9000, 16000), "desk lamp": (600, 2500),
                 "pocket calculator": (90, 300), "electric kettle": (800, 1800), "hiking stove": (150, 700),
                 "garden drone": (400, 3000), "sewing machine": (5000, 12000), "wristwatch": (30, 200),
                 "rice cooker": (1500, 4500)}
MONTHS = "January February March April May June July August September October November December".split()
# profession -> what a person of that profession is known for ({} is an invented name)
WORKS = {"architect": "designing the {} Tower", "novelist": "the novel {}'s Winter", "composer": "the {} Symphony",
         "botanist": "discovering the {} orchid", "engineer": "building the {} Bridge",
         "painter": "the painting {} at Dusk", "astronomer": "discovering the comet {}"}
TEMPLATE_WORDS = {"maker", "founded", "town", "company", "employs", "people", "product", "first", "river", "province",
                  "population", "mayor", "every", "holds", "festival", "born", "known", "prize", "made", "released",
                  "weighs", "grams", "units", "designed", "tower", "bridge", "symphony", "winter", "novel", "comet",
                  "orchid", "painting", "dusk", "designing", "building", "discovering"}


class Names:
    """Invented names, each drawn once: a name used in one document appears in no other."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.invented: set[str] = set()  # lowercase stems handed out so far

    def stem(self) -> str:
        while True:
            r = self.rng
            s = r.choice(ONSETS) + r.choice(VOWELS) + r.choice(ONSETS) + r.choice(VOWELS) + r.choice(CODAS)
            # A stopword would vanish from the index; a template word ("river") would be in many documents.
            if 5 <= len(s) <= 9 and s not in self.invented and s not in STOPWORDS and s not in TEMPLATE_WORDS:
                self.invented.add(s)
                return s.capitalize()

    def person(self) -> str:
        return f"{self.stem()} {self.stem()}"

    def town(self) -> str:
        return self.stem() + self.rng.choice(TOWN_SUFFIXES)

    def product(self) -> str:
        return f"{self.stem()} {self.rng.randint(2, 9)}00"


def a(noun: str) -> str:
    """The noun with its indefinite article."""
    return ("an " if noun[0] in "aeiou" else "a ") + noun


# Each builder returns (title, text, question bank); a bank entry is (attribute, question, answer, gold query).
Doc = tuple[str, str, list[tuple[str, str, str, str]]]


def company(names: Names, r: random.Random) -> Doc:
    name = f"{names.stem()} {r.choice(COMPANY_SUFFIXES)}"
    year, founder, town, staff = r.randint(1890, 2015), names.person(), names.town(), r.randint(40, 9000)
    product, product_year = names.product(), year + r.randint(1, 8)
    text = (f"{name} is {a(r.choice(INDUSTRIES))} maker founded in {year} by {founder} in the town of {town}. "
            f"The company employs {staff} people. "
            f"Its best-known product is the {product}, first sold in {product_year}.")
    return name, text, [
        ("founded", f"In what year was {name} founded?", str(year), f"{name} founded"),
        ("founder", f"Who founded {name}?", founder, f"{name} founded by"),
        ("town", f"In which town was {name} founded?", town, f"{name} town"),
        ("staff", f"How many people does {name} employ?", str(staff), f"{name} employs people"),
        ("product", f"What is the best-known product of {name}?", product, f"{name} best-known product"),
    ]


def town(names: Names, r: random.Random) -> Doc:
    name, river, province, mayor = names.town(), names.stem(), names.stem(), names.person()
    year, population, festival, month = r.randint(1150, 1890), r.randint(800, 90000), names.stem(), r.choice(MONTHS)
    text = (f"{name} is a town on the {river} River in the province of {province}. "
            f"It was founded in {year} and has a population of {population}. Its mayor is {mayor}. "
            f"Every {month}, {name} holds the {festival} Festival.")
    return name, text, [
        ("river", f"On which river is the town of {name}?", river, f"{name} river"),
        ("province", f"In which province is the town of {name}?", province, f"{name} province"),
        ("founded", f"In what year was the town of {name} founded?", str(year), f"{name} town founded"),
        ("population", f"What is the population of {name}?", str(population), f"{name} population"),
        ("mayor", f"Who is the mayor of {name}?", mayor, f"{name} mayor"),
        ("month", f"In which month does {name} hold the {festival} Festival?", month, f"{name} {festival} festival"),
    ]


def person(names: Names, r: random.Random) -> Doc:
    name, birthplace, award = names.person(), names.town(), names.stem()
    profession = r.choice(sorted(WORKS))
    born = r.randint(1900, 1985)
    award_year = born + r.randint(25, 35)
    text = (f"{name} is {a(profession)} born in {born} in {birthplace}. "
            f"{name.split()[1]} is best known for {WORKS[profession].format(names.stem())}. "
            f"In {award_year}, {name} won the {award} Prize.")
    return name, text, [
        ("born", f"In what year was {name} born?", str(born), f"{name} born"),
        ("birthplace", f"In which town was {name} born?", birthplace, f"{name} born town"),
        ("profession", f"What is the profession of {name}?", profession, f"{name} profession"),
        ("award", f"Which prize did {name} win?", f"{award} Prize", f"{name} won prize"),
        ("award_year", f"In what year did {name} win the {award} Prize?", str(award_year), f"{name} {award} prize"),
    ]


def product(names: Names, r: random.Random) -> Doc:
    name, maker, designer = names.product(), f"{names.stem()} {r.choice(COMPANY_SUFFIXES)}", names.person()
    kind = r.choice(sorted(PRODUCT_KINDS))
    year, grams, units = r.randint(1950, 2022), r.randint(*PRODUCT_KINDS[kind]), r.randint(500, 250000)
    text = (f"The {name} is {a(kind)} made by {maker} and first released in {year}. "
            f"It weighs {grams} grams and sold {units} units in its first year. It was designed by {designer}.")
    return name, text, [
        ("maker", f"Which company makes the {name}?", maker, f"{name} made by"),
        ("released", f"In what year was the {name} first released?", str(year), f"{name} released"),
        ("weight", f"How many grams does the {name} weigh?", str(grams), f"{name} weighs grams"),
        ("units", f"How many units of the {name} sold in its first year?", str(units), f"{name} units sold"),
        ("designer", f"Who designed the {name}?", designer, f"{name} designed"),
    ]


def build() -> tuple[list[dict[str, Any]], list[dict[str, Any]], set[str]]:
    """The documents and questions, in a fixed order, and the invented name stems they use."""
    rng = random.Random(SEED)
    names = Names(rng)
    built = [make(names, rng) for make in (company, town, person, product) for _ in range(N_PER_KIND)]
    rng.shuffle(built)  # mix the kinds, so doc ids say nothing about the kind
    docs, questions = [], []
    for i, (title, text, bank) in enumerate(built):
        doc_id = f"doc-{i + 1:03d}"
        docs.append({"doc_id": doc_id, "title": title, "text": text})
        n_questions = 3 if i % 2 == 0 else 2  # 30 * 3 + 30 * 2 = 150
        for attr, question, answer, gold_query in sorted(rng.sample(bank, n_questions)):
            questions.append({"qid": f"{doc_id}-{attr}", "question": question, "answer": answer,
                              "doc_id": doc_id, "gold_query": gold_query})
    test = set(rng.sample(range(len(questions)), N_TEST))
    for i, q in enumerate(questions):
        q["split"] = "test" if i in test else "train"
    return docs, questions, names.invented


def check(docs: list[dict[str, Any]], questions: list[dict[str, Any]], stems: set[str]) -> None:
    """Fail loudly if a question could be answered from another document or is not found by its query."""
    doc_tokens = [set(tokenize(d["title"] + " " + d["text"])) for d in docs]
    for stem in stems:  # an invented name shared by two documents would make a question ambiguous
        hits = [d["doc_id"] for d, toks in zip(docs, doc_tokens) if stem in toks]
        assert len(hits) <= 1, f"name {stem!r} appears in {hits}"
    assert len({q["question"] for q in questions}) == len(questions), "duplicate question"
    by_id = {d["doc_id"]: d for d in docs}
    index = BM25([d["title"] + " " + d["text"] for d in docs])
    for q in questions:
        assert q["answer"] in by_id[q["doc_id"]]["text"], q
        best = index.top_k(q["gold_query"], 1)[0][0]
        assert docs[best]["doc_id"] == q["doc_id"], f"gold query misses: {q}"


def main() -> None:
    """Write both files (and check them first)."""
    docs, questions, stems = build()
    check(docs, questions, stems)
    for name, rows in (("kb_docs.jsonl", docs), ("kb_questions.jsonl", questions)):
        (OUT / name).write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    print(f"wrote {len(docs)} documents, {len(questions)} questions to {OUT}")


if __name__ == "__main__":
    main()
