"""A verifiers environment as its author would publish it (nothing of rlops in it): two-digit additions, one
turn, a two-function rubric. `rlops run configs/verifiers.yaml` trains on it unchanged; `vf-eval` would load
it the same way (`load_environment`)."""

import random
import re

import verifiers as vf
from datasets import Dataset

SYSTEM_PROMPT = "Solve the arithmetic problem. Reply with the number only, no words or working."


def _rows(n: int, rng: random.Random) -> list[dict]:
    rows = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        rows.append({"question": f"What is {a} + {b}?", "answer": str(a + b)})
    return rows


def _last_number(text: str) -> str | None:
    found = re.findall(r"-?\d+", text or "")
    return found[-1] if found else None


def correct_answer(parser, completion, answer) -> float:
    """1 when the reply's last number is the sum."""
    return 1.0 if _last_number(parser.parse_answer(completion) or "") == answer else 0.0


def number_only(parser, completion) -> float:
    """1 when the reply is the number and nothing else (a metric: weight 0)."""
    return 1.0 if re.fullmatch(r"\s*-?\d+\s*", parser.parse_answer(completion) or "") else 0.0


def load_environment(n_train: int = 2000, n_eval: int = 100, seed: int = 0) -> vf.Environment:
    rng = random.Random(seed)
    train, held_out = _rows(n_train, rng), _rows(n_eval, rng)
    parser = vf.Parser()
    rubric = vf.Rubric(funcs=[correct_answer, number_only], weights=[1.0, 0.0], parser=parser)
    return vf.SingleTurnEnv(dataset=Dataset.from_list(train), eval_dataset=Dataset.from_list(held_out),
                            system_prompt=SYSTEM_PROMPT, parser=parser, rubric=rubric)
