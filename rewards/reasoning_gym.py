"""reasoning-gym's own verifiers as a reward: `dataset.score_answer(answer, entry)`.

    score:
      rewards:
        - {name: correct, fn: rewards.reasoning_gym.score_answer}      # the verifier of the rollout's own dataset

With no params the reward verifies each rollout with its own dataset and config, read from the rollout's
metadata (tasks/reasoning_gym.py stores them), so swapping `task.params.dataset` is the only edit a run
needs. That is as reproducible as naming them: the rollout batch id covers the task's params, and the
reward's version covers the installed reasoning-gym's version (its reach records it as a library).

`dataset` and `config` may still be given (a reward meant for one dataset only): then they must be the
task's. Config validation refuses a run whose reward names another dataset or config than its task
(`_task_check`, before any compute), and a stored rollout of another dataset or config (a rescore of an
old run) is an error row naming both, never a score under the wrong verifier; as for any reward, the score
stage fails when more than `score.max_error_fraction` of a batch are errors.

The entry is regenerated from the rollout's metadata (seed, size, index: tasks/reasoning_gym.py),
not read back from JSON, because some verifiers compare the entry's tuples and JSON has only lists;
a regenerated question that differs from the rollout's (another reasoning-gym release) is an error.

The answer is the text of the last <answer>...</answer> block of the final reply, or the whole reply
(stripped) when it has none: the task's "tags" and "plain" answer formats both score here.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from rewards.base import reward
from rewards.builtin import final_answer
from storage.ids import canonical_json
from storage.schema import Rollout

ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def _task_check(task_name: str, task_params: dict[str, Any], params: dict[str, Any]) -> list[str]:
    """A dataset or config the reward is given must be the reasoning_gym task's (the rollouts carry the task's)."""
    if task_name.rsplit(".", 1)[-1] != "reasoning_gym":
        return []
    task = {"dataset": task_params.get("dataset"), "config": task_params.get("config") or {}}
    return [f"params.{key} is {canonical_json(params[key])}, but the task's is {canonical_json(task[key])}: "
            f"remove it (the reward then verifies each rollout with its own {key}) or make it the task's"
            for key in ("dataset", "config")
            if params.get(key) is not None and canonical_json(params[key]) != canonical_json(task[key])]


@reward(low=0.0, high=1.0, task_check=_task_check)
def score_answer(rollout: Rollout, dataset: str | None = None,
                 config: dict[str, Any] | None = None) -> tuple[float, dict[str, Any]]:
    """The reasoning-gym verifier's score of the final reply's answer, in [0, 1] (many verifiers give
    partial credit). `dataset` / `config`: None follows the rollout's own; given, the rollout must match.
    A verifier that raises on the answer (it cannot parse it) scores 0.0, with the reason in details: the
    answer is the model's text, and text a verifier cannot read is not right."""
    meta = rollout.metadata
    theirs = canonical_json({"dataset": meta["dataset"], "config": meta["config"]})
    dataset = meta["dataset"] if dataset is None else dataset
    ours = canonical_json({"dataset": dataset, "config": meta["config"] if config is None else config})
    if ours != theirs:
        raise ValueError(f"the rollout is from reasoning-gym {theirs}, this reward verifies {ours}: "
                         "give the reward the task's dataset and config, or neither")
    ds = _dataset(dataset, ours, meta["seed"], meta["size"])
    entry = ds[meta["index"]]
    question = next((m.content for m in rollout.messages if m.role == "user"), None)
    if question != entry["question"]:
        raise ValueError(f"entry {meta['index']} of {dataset!r} (seed {meta['seed']}) is not the rollout's question: "
                         f"the rollout comes from another reasoning-gym version ({meta.get('reasoning_gym')})")
    answer = extract_answer(final_answer(rollout))
    details: dict[str, Any] = {"answer": answer, "expected": meta["answer"]}
    try:
        value = float(ds.score_answer(answer, entry))
    except Exception as e:  # noqa: BLE001 - see the docstring
        return 0.0, {**details, "verifier_error": f"{type(e).__name__}: {e}"[:300]}
    return value, details


def extract_answer(reply: str | None) -> str | None:
    """The last <answer>...</answer> block's text, else the whole reply, stripped (None: no final reply)."""
    if reply is None:
        return None
    tagged = ANSWER_RE.findall(reply)
    return (tagged[-1] if tagged else reply).strip()


@functools.lru_cache(maxsize=16)
def _dataset(name: str, key: str, seed: int, size: int) -> Any:
    # One dataset object per (dataset, config, seed, size): a batch's rollouts share a few; `key` is the
    # canonical JSON of name and config (a dict is not hashable).
    import reasoning_gym

    return reasoning_gym.create_dataset(name, seed=seed, size=size, **json.loads(key)["config"])
