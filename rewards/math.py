"""Math answers checked by Hugging Face's math-verify: LaTeX, `\\boxed{}`, fractions, sets, intervals, plain numbers.

    score:
      rewards:
        - {name: correct, fn: rewards.math.equivalent}                       # against metadata["answer"]
        - {name: correct, fn: rewards.math.equivalent, params: {key: solution}}

The gold answer is parsed once per distinct text (a group shares one prompt, so its G rollouts parse it once);
the reply is parsed with math-verify's default extraction (the last `\\boxed{}`, else LaTeX, else an expression).
A gold answer math-verify cannot parse makes the rollout "not applicable" (TRL's `accuracy_reward` skips it the
same way), so a bad row of data is neither a failure nor a zero. math-verify's timeouts use SIGALRM, which works
in the main thread only: in a worker thread (score.workers > 1 with a judge) they are off, as TRL does.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

from rewards.base import NOT_APPLICABLE, reward
from rewards.builtin import final_answer
from storage.schema import Rollout

PARSE_SECONDS = 5  # per parse and per comparison: sympy can hang on adversarial input


@reward(low=0.0, high=1.0)
def equivalent(rollout: Rollout, key: str = "answer") -> Any:
    """1.0 if the final reply's answer is mathematically equal to `metadata[key]` (math-verify), else 0.0;
    not applicable when the gold answer does not parse. Details: both parsed forms."""
    from math_verify import parse, verify

    gold_text = rollout.metadata.get(key)
    if gold_text is None:
        raise KeyError(f"the rollout's metadata has no {key!r} (keys: {', '.join(rollout.metadata)})")
    gold = _gold(str(gold_text), _timeout())
    if not gold:
        return NOT_APPLICABLE, {"gold": str(gold_text), "gold_parsed": None}
    answer = parse(final_answer(rollout) or "", parsing_timeout=_timeout())
    ok = bool(answer) and verify(gold, answer, timeout_seconds=_timeout())
    return float(ok), {"gold_parsed": str(gold), "answer_parsed": str(answer) if answer else None}


@functools.lru_cache(maxsize=4096)
def _gold(text: str, timeout: int | None) -> list[Any]:
    from math_verify import parse

    return parse(text, parsing_timeout=timeout)


def _timeout() -> int | None:
    return PARSE_SECONDS if threading.current_thread() is threading.main_thread() else None
