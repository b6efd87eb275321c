"""reasoning-gym's own verifiers as a reward: `dataset.score_answer(answer, entry)`.

    score:
      rewards:
        - {name: correct, fn: rewards.reasoning_gym.score_answer, params: {dataset: chain_sum, config: {...}}}

The dataset and its config are the reward's params, so they are part of its version, next to the
installed reasoning-gym's version (the reach records it as a library): a changed config or library
gives a new reward version. They must be the task's (`task.params.dataset` and `.config`; a YAML
anchor writes them once, see configs/reasoning_gym.yaml); a rollout of another dataset or config is
an error row, never a score under the wrong verifier.

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


@reward(low=0.0, high=1.0)
def score_answer(rollout: Rollout, dataset: str, config: dict[str, Any] | None = None) -> tuple[float, dict[str, Any]]:
    """The reasoning-gym verifier's score of the final reply's answer, in [0, 1] (many verifiers give
    partial credit). A verifier that raises on the answer (it cannot parse it) scores 0.0, with the
    reason in details: the answer is the model's text, and text a verifier cannot read is not right."""
    meta = rollout.metadata
    ours = canonical_json({"dataset": dataset, "config": config or {}})
    theirs = canonical_json({"dataset": meta["dataset"], "config": meta["config"]})
    if ours != theirs:
        raise ValueError(f"the rollout is from reasoning-gym {theirs}, this reward verifies {ours}: "
                         "give the reward the task's dataset and config")
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
