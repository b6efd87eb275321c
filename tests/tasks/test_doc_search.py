"""The doc_search task: the shipped knowledge base, its tools, and the oracle SFT dataset."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tasks.base import parse_tool_calls
from tasks.data import make_kb
from tasks.doc_search import DATA, TOOL_SPECS, load_jsonl, make_task, write_oracle_dataset

DOCS = load_jsonl(DATA / "kb_docs.jsonl")
QUESTIONS = load_jsonl(DATA / "kb_questions.jsonl")
BY_ID = {d["doc_id"]: d for d in DOCS}
SEARCH_LINE = re.compile(r"^(doc-\d{3}): (.+) — (.+\.)$")
SEARCH = make_task().tools["search"]


def test_committed_files_are_what_make_kb_writes() -> None:
    docs, questions, stems = make_kb.build()
    assert (docs, questions) == (DOCS, QUESTIONS)
    make_kb.check(docs, questions, stems)  # names unique to one document, answers in it, gold queries rank it first


def test_knowledge_base_shape() -> None:
    assert len(DOCS) == 60 and len(QUESTIONS) == 150
    assert len(BY_ID) == 60 and len({d["title"] for d in DOCS}) == 60
    assert len({q["qid"] for q in QUESTIONS}) == 150 and len({q["question"] for q in QUESTIONS}) == 150
    assert [q["split"] for q in QUESTIONS].count("test") == 30
    for d in DOCS:
        assert 2 <= len(re.findall(r"\.(?:\s|$)", d["text"])) <= 4, d
    for q in QUESTIONS:
        assert q["answer"] in BY_ID[q["doc_id"]]["text"], q


@pytest.mark.parametrize("q", QUESTIONS, ids=[q["qid"] for q in QUESTIONS])
def test_search_finds_the_gold_document_by_its_gold_query(q: dict[str, str]) -> None:
    lines = SEARCH(q["gold_query"]).splitlines()
    hits = [SEARCH_LINE.match(line).group(1) for line in lines]  # type: ignore[union-attr]
    assert q["doc_id"] in hits


def test_search_output_format_and_k() -> None:
    lines = SEARCH("town river province").splitlines()
    assert len(lines) == 3
    for line in lines:
        doc_id, title, first_sentence = SEARCH_LINE.match(line).groups()  # type: ignore[union-attr]
        assert BY_ID[doc_id]["title"] == title and BY_ID[doc_id]["text"].startswith(first_sentence)
    assert len(make_task(k=1).tools["search"]("town river province").splitlines()) == 1


@pytest.mark.parametrize("query", ["", "the of and", "zzzz qqqq"])
def test_search_without_matches_says_so(query: str) -> None:
    assert SEARCH(query).startswith("No documents match")


def test_read() -> None:
    read = make_task().tools["read"]
    doc = DOCS[4]
    assert read(doc["doc_id"]) == f"{doc['title']}\n{doc['text']}"
    assert read(f" {doc['doc_id']}\n") == read(doc["doc_id"])


@pytest.mark.parametrize("doc_id", ["doc-999", "", "Vobourv Labs"])
def test_read_unknown_id_is_an_error_text(doc_id: str) -> None:
    out = make_task().tools["read"](doc_id)
    assert out.startswith("Error: no document with id") and "search" in out


def test_task_prompts_and_metadata() -> None:
    task = make_task(max_turns=6)
    assert task.name == "doc_search" and task.max_turns == 6 and task.tool_specs == TOOL_SPECS
    assert set(task.tools) == {spec["function"]["name"] for spec in TOOL_SPECS}
    train, test = task.prompts("train"), task.prompts("test")
    assert (len(train), len(test)) == (120, 30)
    assert not {p.question for p in train} & {p.question for p in test}
    q = {q["qid"]: q for q in QUESTIONS}[train[0].prompt_id]
    assert train[0].question == q["question"]
    assert train[0].metadata == {"answer": q["answer"], "answer_doc_id": q["doc_id"], "gold_query": q["gold_query"]}
    small = make_task(n_train=5, n_test=2)
    assert small.prompts("train") == train[:5] and small.prompts("test") == test[:2]
    with pytest.raises(ValueError, match="splits"):
        task.prompts("dev")


def test_system_prompt_teaches_the_tools() -> None:
    task = make_task()
    system = task.messages(task.prompts("test")[0])[0]["content"]
    assert "- search(query):" in system and "- read(doc_id):" in system and "<tool_call>" in system


def test_oracle_dataset(tmp_path: Path) -> None:
    path = tmp_path / "sft" / "oracle.jsonl"
    assert write_oracle_dataset(path) == 120
    assert not list(path.parent.glob("*.tmp"))
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    prompts = make_task().prompts("train")
    assert len(rows) == 120
    for row, prompt in zip(rows, prompts):
        assert row["tools"] == TOOL_SPECS
        m = row["messages"]
        assert [x["role"] for x in m] == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"]
        assert m[:2] == make_task().messages(prompt)
        for turn, (call_msg, result_msg, name) in enumerate([(m[2], m[3], "search"), (m[4], m[5], "read")]):
            (parsed,) = parse_tool_calls(call_msg["content"], turn)
            (openai_call,) = call_msg["tool_calls"]
            assert openai_call == {"id": parsed.id, "type": "function",
                                   "function": {"name": name, "arguments": parsed.arguments}}
            assert result_msg["tool_call_id"] == parsed.id and result_msg["name"] == name
        assert json.loads(m[2]["tool_calls"][0]["function"]["arguments"]) == {"query": prompt.metadata["gold_query"]}
        assert prompt.metadata["answer_doc_id"] + ":" in m[3]["content"]
        assert prompt.metadata["answer"] in m[5]["content"]
        assert m[6] == {"role": "assistant", "content": prompt.metadata["answer"]}


def test_oracle_dataset_n_split_and_task_params(tmp_path: Path) -> None:
    path = tmp_path / "oracle.jsonl"
    # The pipeline calls it as write_oracle_dataset(path, split="train", **task.params).
    assert write_oracle_dataset(path, split="test", n=4, k=1, n_test=3) == 3
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["messages"][1]["content"] for r in rows] == [p.question for p in make_task().prompts("test")[:3]]
    assert all(len(r["messages"][3]["content"].splitlines()) == 1 for r in rows)  # k=1: one search hit
