"""A doc_search agent written as a plain OpenAI tool-calling agent.

It knows nothing about rlops: it takes an `openai.AsyncOpenAI` client and a model name, offers
two tools (`search`, `read`) over a small knowledge base, and loops over the model's `tool_calls`
until the model answers. Point the client at any OpenAI-compatible endpoint to run it; point it
at `rlops serve` (or let `rlops run configs/doc_search_agent.yaml` do it) to train it.

    python examples/doc_search_openai/agent.py --base-url http://127.0.0.1:8000/v1 --model base \\
        "In which town was Grougo Ninael born?"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
from collections import Counter
from pathlib import Path
from typing import Any

import openai

DOCS = [json.loads(line) for line in (Path(__file__).parent / "kb_docs.jsonl").read_text().splitlines() if line.strip()]
SYSTEM_PROMPT = (
    "You answer questions about a private knowledge base. Its facts are not public, so do not guess: "
    "search for the entity in the question, read the document that describes it, then reply with "
    "the short answer only (a name, a number or a year)."
)
TOOLS: list[dict[str, Any]] = [
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
MAX_TURNS = 4  # model calls per question: search, read and answer take three


# -- the tools: BM25 search and read over DOCS -----------------------------------------------

WORD = re.compile(r"[a-z0-9]+")
SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
STOPWORDS = set("a an and are as at be by did do does for from has have he her his how in is it its of on or "
                "she that the their them they this to was were what when where which who whom why with".split())


def _terms(text: str) -> list[str]:
    return [t for t in WORD.findall(text.lower()) if t not in STOPWORDS]


_TF = [Counter(_terms(f"{d['title']} {d['text']}")) for d in DOCS]
_LEN = [sum(tf.values()) for tf in _TF]
_DF = Counter(t for tf in _TF for t in tf)
_IDF = {t: math.log((len(DOCS) - f + 0.5) / (f + 0.5) + 1.0) for t, f in _DF.items()}


def search(query: str, k: int = 3) -> str:
    """The k best documents for `query` by BM25 (k1 = 1.5, b = 0.75)."""
    avg = sum(_LEN) / len(_LEN)
    scores = []
    for i, (tf, n) in enumerate(zip(_TF, _LEN)):
        norm = 1.5 * (0.25 + 0.75 * n / avg)
        scores.append((sum(_IDF[t] * tf[t] * 2.5 / (tf[t] + norm) for t in _terms(str(query)) if tf.get(t)), i))
    hits = [i for s, i in sorted(scores, key=lambda p: (-p[0], p[1]))[:k] if s > 0]
    if not hits:
        return f"No documents match {query!r}. Try other keywords, such as a name from the question."
    return "\n".join(f"{DOCS[i]['doc_id']}: {DOCS[i]['title']} — {SENTENCE_END.split(DOCS[i]['text'], 1)[0]}"
                     for i in hits)


def read(doc_id: str) -> str:
    """The full text of one document."""
    doc = next((d for d in DOCS if d["doc_id"] == str(doc_id).strip()), None)
    if doc is None:
        return f"Error: no document with id {doc_id!r}. Use an id returned by search, such as {DOCS[0]['doc_id']!r}."
    return f"{doc['title']}\n{doc['text']}"


def run_tool(name: str, arguments: str) -> str:
    """A tool call's result; every failure is a message for the model, never an exception."""
    tools = {"search": search, "read": read}
    if name not in tools:
        return f"error: unknown tool {name!r}; available: read, search"
    try:
        args = json.loads(arguments)
    except json.JSONDecodeError as e:
        return f"error: arguments of {name!r} are not valid JSON ({e})"
    if not isinstance(args, dict):
        return f"error: arguments of {name!r} must be a JSON object"
    try:
        return tools[name](**args)
    except TypeError as e:
        return f"error: tool {name!r} raised TypeError: {e}"


# -- the agent loop --------------------------------------------------------------------------


async def rollout(client: openai.AsyncOpenAI, model: str, prompt: str) -> dict[str, Any]:
    """Answer one question; returns the conversation (the last message is the answer)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": prompt}]
    for turn in range(MAX_TURNS):
        try:
            response = await client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
        except openai.BadRequestError:  # the conversation outgrew the model's context: stop here
            break
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls or turn == MAX_TURNS - 1:
            break
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "name": call.function.name,
                             "content": run_tool(call.function.name, call.function.arguments)})
    return {"messages": messages}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("question")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default="base")
    args = parser.parse_args()
    client = openai.AsyncOpenAI(base_url=args.base_url, api_key="unused")
    for m in asyncio.run(rollout(client, args.model, args.question))["messages"]:
        print(f"[{m['role']}] {m.get('content') or ''} {json.dumps(m['tool_calls']) if m.get('tool_calls') else ''}")


if __name__ == "__main__":
    main()
