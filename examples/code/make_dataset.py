"""Write a small code task that SmolLM2-135M partly solves: one-line Python functions from templates, each with
assert tests (MBPP's layout: a `prompt`, a `tests` list), for configs/code.yaml.

    python examples/code/make_dataset.py [--out examples/code/data] [--train 600] [--test 100]

Each row: {"prompt": "Write a Python function `beta_add_7(x)` that returns x plus 7.", "tests":
["assert beta_add_7(0) == 7", ...], "entry_point": "beta_add_7", "template": "add"}. Constants and names are drawn from a seed; the test split comes
from another seed, and a prompt in it is dropped from train. `rewards.code.tests_passed` runs the reply's last
code block against the tests in the sandbox.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

WORDS = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta", "zeta", "iota"]


def add(rng):
    k = rng.randint(2, 40)
    return f"{rng.choice(WORDS)}_add_{k}", f"(x)` that returns x plus {k}", [(0,), (5,), (-3,)], lambda x: x + k


def times(rng):
    k = rng.randint(2, 15)
    return f"{rng.choice(WORDS)}_times_{k}", f"(x)` that returns x multiplied by {k}", [(0,), (3,), (-2,)], lambda x: x * k


def divisible(rng):
    k = rng.randint(2, 9)
    return f"{rng.choice(WORDS)}_divisible_by_{k}", f"(n)` that returns True if n is divisible by {k}, else False", \
        [(0,), (k,), (k + 1,), (3 * k,)], lambda n: n % k == 0


def larger(rng):
    w = rng.choice(WORDS)
    return f"larger_{w}", "(a, b)` that returns the larger of a and b", [(1, 2), (5, 3), (-1, -4)], max


def reverse(rng):
    w = rng.choice(WORDS)
    return f"reverse_{w}", "(s)` that returns the string s reversed", [("abc",), ("",), ("racecar!",)], lambda s: s[::-1]


def count(rng):
    c = rng.choice("aeiost")
    return f"{rng.choice(WORDS)}_count_{c}", f"(s)` that returns how many times the letter '{c}' appears in the string s", \
        [("",), (c * 3,), (f"x{c}y{c}",)], lambda s: s.count(c)


def square_plus(rng):
    k = rng.randint(1, 9)
    return f"{rng.choice(WORDS)}_square_plus_{k}", f"(x)` that returns x squared plus {k}", [(0,), (3,), (-2,)], lambda x: x * x + k


def total(rng):
    w = rng.choice(WORDS)
    return f"total_{w}", "(xs)` that returns the sum of the numbers in the list xs", [([],), ([1, 2, 3],), ([-5, 5, 7],)], sum


def last(rng):
    w = rng.choice(WORDS)
    return f"last_{w}", "(xs)` that returns the last element of the list xs", [([1],), ([4, 5, 6],), (["a", "b"],)], \
        lambda xs: xs[-1]


def repeat(rng):
    k = rng.randint(2, 5)
    return f"{rng.choice(WORDS)}_repeat_{k}", f"(s)` that returns the string s repeated {k} times", [("ab",), ("",), ("x",)], lambda s: s * k


TEMPLATES = [add, times, divisible, larger, reverse, count, square_plus, total, last, repeat]


def rows(n: int, seed: int, exclude: set[str]) -> list[dict]:
    rng, out, seen = random.Random(seed), [], set(exclude)
    for _ in range(50 * n):
        if len(out) == n:
            break
        template = rng.choice(TEMPLATES)
        name, text, args, fn = template(rng)
        prompt = f"Write a Python function `{name}{text}."
        if prompt in seen:
            continue
        seen.add(prompt)
        tests = [f"assert {name}({', '.join(map(repr, a))}) == {fn(*a)!r}" for a in args]
        out.append({"prompt": prompt, "tests": tests, "entry_point": name, "template": template.__name__})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "data"))
    parser.add_argument("--train", type=int, default=600)
    parser.add_argument("--test", type=int, default=100)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    test = rows(args.test, 1_000_000, set())
    train = rows(args.train, 0, {r["prompt"] for r in test})
    for name, table in (("train", train), ("test", test)):
        tmp = out / f".{name}.jsonl.tmp"
        tmp.write_text("".join(json.dumps(r) + "\n" for r in table))
        tmp.replace(out / f"{name}.jsonl")
    print(f"{out}: train {len(train)}, test {len(test)} rows")


if __name__ == "__main__":
    main()
