"""Doc search: answer questions about invented entities by searching and reading a small knowledge base.

The documents (tasks/data/kb_docs.jsonl) describe fictional companies, towns, people and
products, so the model has to use the tools: `search(query)` (BM25, top k) and
`read(doc_id)`. Each question (tasks/data/kb_questions.jsonl) is answerable from exactly one
document and carries its answer, that document's id and a "gold query" that finds it.
`write_oracle_dataset` turns those into scripted search -> read -> answer demonstrations for
SFT warm-starting. Both files come from tasks/data/make_kb.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable

from tasks.base import Prompt, Task, write_chat_jsonl
from tasks.bm25 import BM25

DATA = Path(__file__).parent / "data"
SPLITS = ("train", "test")
SYSTEM_PROMPT = (
    "You answer questions about a private knowledge base. Its facts are not public, so do not guess: "
    "search for the entity in the question, read the document that describes it, then reply with "
    "the short answer only (a name, a number or a year)."
)
TOOL_SPECS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the knowledge base; returns the best matches as 'doc_id: title — first sentence'.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string", "description": "a few keywords, e.g. a name"}},
                "required": ["query"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read",
            "description": "Read the full text of one document by its id.",
            "parameters": {
                "type": "object",
                "properties": {"doc_id": {"type": "string", "description": "an id returned by search"}},
                "required": ["doc_id"],
            },
        },
    },
]
SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def load_jsonl(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSONL file."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def make_tools(docs: list[dict[str, Any]], k: int = 3) -> dict[str, Callable[..., str]]:
    """`search` and `read` over `docs` (rows with doc_id, title, text). Errors come back as text for
    the model to read, never as exceptions, so one bad call does not end an episode."""
    index = BM25([f"{d['title']} {d['text']}" for d in docs])
    by_id = {d["doc_id"]: d for d in docs}

    def search(query: str) -> str:
        hits = index.top_k(str(query), k)
        if not hits:
            return f"No documents match {query!r}. Try other keywords, such as a name from the question."
        lines = []
        for i, _ in hits:
            d = docs[i]
            lines.append(f"{d['doc_id']}: {d['title']} — {SENTENCE_END.split(d['text'], 1)[0]}")
        return "\n".join(lines)

    def read(doc_id: str) -> str:
        d = by_id.get(str(doc_id).strip())
        if d is None:
            example = docs[0]["doc_id"]
            return f"Error: no document with id {doc_id!r}. Use an id returned by search, such as {example!r}."
        return f"{d['title']}\n{d['text']}"

    return {"search": search, "read": read}


def make_task(k: int = 3, max_turns: int = 4, n_train: int | None = None, n_test: int | None = None) -> Task:
    """Build the doc_search task: `k` results per search, `max_turns` assistant turns (search, read and
    answer take three), and the first `n_train` / `n_test` questions of each split (None: all)."""
    docs = load_jsonl(DATA / "kb_docs.jsonl")
    limits = {"train": n_train, "test": n_test}
    splits: dict[str, list[Prompt]] = {s: [] for s in SPLITS}
    for q in load_jsonl(DATA / "kb_questions.jsonl"):
        metadata = {"answer": q["answer"], "answer_doc_id": q["doc_id"], "gold_query": q["gold_query"]}
        splits[q["split"]].append(Prompt(q["qid"], q["question"], metadata))

    def prompts(split: str) -> list[Prompt]:
        if split not in splits:
            raise ValueError(f"doc_search has splits {SPLITS}, not {split!r}")
        return splits[split][: limits[split]]  # slicing copies, so callers may shuffle the list

    return Task(
        name="doc_search",
        system_prompt=SYSTEM_PROMPT,
        prompts=prompts,
        tools=make_tools(docs, k),
        tool_specs=TOOL_SPECS,
        max_turns=max_turns,
    )


def oracle_messages(task: Task, prompt: Prompt) -> list[dict[str, Any]]:
    """The scripted episode for one prompt: search by the gold query, read the gold document, answer.
    Tool results come from calling the task's own tools, so they match what a rollout would see."""
    messages = task.messages(prompt)
    calls = [
        ("search", {"query": prompt.metadata["gold_query"]}),
        ("read", {"doc_id": prompt.metadata["answer_doc_id"]}),
    ]
    for turn, (name, arguments) in enumerate(calls):
        call_id = f"call_{turn}_0"  # the id parse_tool_calls gives the first call of this turn
        body = json.dumps({"name": name, "arguments": arguments})
        messages.append(
            {
                "role": "assistant",
                "content": f"<tool_call>{body}</tool_call>",
                "tool_calls": [
                    {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
                ],
            }
        )
        result = task.tools[name](**arguments)
        messages.append({"role": "tool", "tool_call_id": call_id, "name": name, "content": result})
    messages.append({"role": "assistant", "content": str(prompt.metadata["answer"])})
    return messages


def write_oracle_dataset(path: str | Path, split: str = "train", n: int | None = None, **params: Any) -> int:
    """Write SFT demonstrations for the first `n` prompts of `split` (None: all) as JSONL lines
    {"messages": [...], "tools": TOOL_SPECS}; returns the number of lines. `params` are the task's
    (`make_task`'s), so the demonstrations see the same tools as the rollouts."""
    task = make_task(**params)
    rows = ({"messages": oracle_messages(task, p), "tools": task.tool_specs} for p in task.prompts(split)[:n])
    return write_chat_jsonl(path, rows)
