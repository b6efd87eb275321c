"""reasoning-gym: any of its procedural datasets (106 in 0.1.25) as a single-turn task.

    task: {name: reasoning_gym, params: {dataset: chain_sum, config: {max_terms: 2}, size: 2000, seed: 0}}

Each prompt is one dataset entry's question; the reward is the dataset's own verifier
(`rewards.reasoning_gym.score_answer`, which regenerates the entry from the metadata stored here).
The train split is `create_dataset(dataset, seed=seed, size=size, **config)`; the test split the same
dataset under `eval_seed` (default `seed + EVAL_SEED_OFFSET`). reasoning-gym seeds entry i with
`seed + i`, so `seed + 1` would shift the same entries by one: the offset keeps the two ranges apart, and
a question the test split holds is dropped from train anyway (small configs repeat questions). So the
splits never share a question, and the train split can come out smaller than `size`.

Bad params (an unknown dataset, a config field the dataset does not have, a value its config rejects)
are a `TaskParamsError` naming the dataset and the close names, raised when the task is built, which
config validation does before any compute.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import importlib.metadata
from pathlib import Path
from typing import Any, Literal

from tasks.base import Prompt, Task, TaskParamsError, write_chat_jsonl

EVAL_SEED_OFFSET = 1_000_000  # above any train size: entry seeds seed..seed+size-1 never reach the test split's
# How the model is asked to answer. The reward reads the last <answer>...</answer> block, or the whole
# reply when there is none, so both formats score with the same reward (rewards/reasoning_gym.py).
SYSTEM_PROMPTS = {
    # reasoning-gym's own "default" prompt: think, then the answer in tags (models that can reason)
    "tags": "Given a problem, your task is to answer the question by thinking step-by-step in a clear and "
            "specific manner.\nOnce you have thought about the reasoning process, provide the answer in the "
            "following format:\n<answer>answer here</answer>\nDo not explain your reasoning inside the answer "
            "tags, provide only the final answer.",
    # the answer alone: what a small model learns in a few steps (configs/reasoning_gym.yaml)
    "plain": "Solve the problem. Reply with the final answer only, no words or working.",
}
AnswerFormat = Literal["tags", "plain"]
DEFAULT_FORMAT: AnswerFormat = "tags"


def make_task(
    dataset: str,
    config: dict[str, Any] | None = None,
    size: int = 1000,
    seed: int = 0,
    eval_size: int = 100,
    eval_seed: int | None = None,
    answer_format: AnswerFormat = DEFAULT_FORMAT,
) -> Task:
    """Build a task from reasoning-gym dataset `dataset` under `config` (its config class's fields, e.g.
    `{min_terms: 2, max_terms: 2}` for chain_sum; `seed` and `size` are params of their own).

    `size` entries from `seed` make the train split (questions the test split holds are dropped),
    `eval_size` entries from `eval_seed` (None: `seed + EVAL_SEED_OFFSET`) the test split; a question
    repeated within a split is kept once. `answer_format`: "tags" asks for the answer in
    <answer></answer> after step-by-step thinking, "plain" for the answer alone.
    """
    config = dict(config or {})
    test_seed = seed + EVAL_SEED_OFFSET if eval_seed is None else eval_seed
    test = entries(dataset, config, seed=test_seed, size=eval_size)
    held_out = {p.question for p in test}
    splits = {"test": test, "train": [p for p in entries(dataset, config, seed=seed, size=size) if p.question not in held_out]}

    def prompts(split: str) -> list[Prompt]:
        if split not in splits:
            raise ValueError(f"reasoning_gym has splits {tuple(splits)}, not {split!r}")
        return list(splits[split])  # a copy: callers may shuffle or trim it

    return Task(name="reasoning_gym", system_prompt=SYSTEM_PROMPTS[answer_format], prompts=prompts, max_turns=1)


def write_oracle_dataset(path: str | Path, split: str = "train", n: int | None = None, **params: Any) -> int:
    """Write SFT demonstrations (system, question, the entry's answer in the task's answer format) for the
    first `n` prompts of `split` that have an answer (None: all) as JSONL; returns the number of lines.
    Entries without a single answer (puzzles any valid solution solves) are skipped."""
    task = make_task(**params)
    tags = params.get("answer_format", DEFAULT_FORMAT) == "tags"
    answered = [p for p in task.prompts(split) if p.metadata["answer"] is not None][:n]
    rows = (
        {"messages": task.messages(p) + [{"role": "assistant", "content": oracle_reply(p.metadata["answer"], tags)}],
         "tools": []}
        for p in answered
    )
    return write_chat_jsonl(path, rows)


def oracle_reply(answer: str, tags: bool) -> str:
    return f"<answer>{answer}</answer>" if tags else answer


def library_version() -> str:
    """The installed reasoning-gym's version (its `__version__` attribute lags the release: 0.1.19 in 0.1.25)."""
    return importlib.metadata.version("reasoning-gym")


def entries(dataset: str, config: dict[str, Any], *, seed: int, size: int) -> list[Prompt]:
    """The first `size` entries of `dataset` under `config` and `seed` as prompts, a repeated question
    kept once. Each prompt's metadata says how to regenerate its entry (dataset, config, seed, size, index)."""
    ds = create(dataset, config, seed=seed, size=size)
    version = library_version()
    out, seen = [], set()
    for index in range(size):
        try:
            entry = ds[index]
        except Exception as e:  # noqa: BLE001 - a generator that fails on this config is a config problem
            raise TaskParamsError([f"task.params.config: reasoning-gym dataset {dataset!r} fails to generate "
                                   f"entry {index} under {config}: {type(e).__name__}: {e}"]) from e
        question = str(entry["question"])
        if question in seen:
            continue
        seen.add(question)
        answer = entry.get("answer")
        metadata = {"dataset": dataset, "config": config, "seed": seed, "size": size, "index": index,
                    "answer": None if answer is None else str(answer), "reasoning_gym": version}
        out.append(Prompt(prompt_id(dataset, question), question, metadata))
    return out


def prompt_id(dataset: str, question: str) -> str:
    """A stable id from the dataset name and question text, so it survives reordering and resizing."""
    return "rg-" + hashlib.sha1(f"{dataset}\n{question}".encode()).hexdigest()[:12]


def create(dataset: str, config: dict[str, Any], *, seed: int, size: int) -> Any:
    """`reasoning_gym.create_dataset(dataset, seed=seed, size=size, **config)`, or a TaskParamsError that
    names the dataset and what is wrong: an unknown name (with the close names), an unknown config field
    (with the fields there are), or a value the dataset's config or generator rejects."""
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    if dataset not in DATASETS:
        close = difflib.get_close_matches(dataset, DATASETS, n=5, cutoff=0.5)
        hint = f"close names: {', '.join(close)}" if close else f"none is close; all {len(DATASETS)}: {', '.join(sorted(DATASETS))}"
        raise TaskParamsError([f"task.params.dataset: unknown reasoning-gym dataset {dataset!r} ({hint})"])
    if dataset == "composite":  # its config holds DatasetSpec objects, which neither YAML nor the reward's params can
        raise TaskParamsError(["task.params.dataset: 'composite' (a weighted mix of datasets) is not supported: "
                               "its config is made of DatasetSpec objects; train on one dataset per run"])
    fields = [f.name for f in dataclasses.fields(DATASETS[dataset][1]) if f.name not in ("seed", "size")]
    problems = [f"task.params.config.{key}: set task.params.{key} instead (one per split)"
                for key in config if key in ("seed", "size")]
    problems += [f"task.params.config.{key}: {dataset!r} has no such config field (fields: {', '.join(fields) or 'none'})"
                 for key in config if key not in fields and key not in ("seed", "size")]
    if problems:
        raise TaskParamsError(problems)
    try:
        return reasoning_gym.create_dataset(dataset, seed=seed, size=size, **config)
    except Exception as e:  # noqa: BLE001 - the dataset's own validation (asserts, ValueErrors) says what is wrong
        raise TaskParamsError([f"task.params.config: reasoning-gym dataset {dataset!r} rejects {config}: "
                               f"{type(e).__name__}: {e}"]) from e
