"""Write a math dataset the way verl users keep theirs, for configs/dataset_math.yaml.

    python examples/dataset_math/make_dataset.py [--out examples/dataset_math/data] [--train 2000] [--test 100]

It writes, from reasoning-gym's `basic_arithmetic` (two terms of one or two digits, + and -, no negatives or
parentheses: what SmolLM2-135M partly solves):
- train.parquet and test.parquet in verl's layout: data_source, prompt (chat messages), ability,
  reward_model {style: rule, ground_truth}, extra_info {split, index}, plus TRL's `solution` column (the
  ground truth again, the column `trl.rewards.accuracy_reward` reads);
- sft.jsonl: chat demonstrations ({"messages": [...]}) of the answer format, `\\boxed{N}`, on train questions
  other than the RL ones' first steps, for the SFT warm-start.

The held-out split comes from another seed, and a question in it is dropped from train. Nothing here is
rlops-specific: the files are what verl's examples/data_preprocess scripts write.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import reasoning_gym

CONFIG = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2, "operators": ("+", "-"),
          "allow_parentheses": False, "allow_negation": False}
INSTRUCTION = "Put the final answer in \\boxed{}."
TEST_SEED = 1_000_000  # reasoning-gym seeds entry i with seed + i: far apart, the splits share no seed


def rows(split: str, seed: int, size: int, exclude: set[str]) -> list[dict]:
    ds = reasoning_gym.create_dataset("basic_arithmetic", seed=seed, size=size, **CONFIG)
    out, seen = [], set(exclude)
    for entry in ds:
        question = f"{entry['question']} {INSTRUCTION}"
        if question in seen:
            continue
        seen.add(question)
        out.append({"data_source": "reasoning_gym/basic_arithmetic",
                    "prompt": [{"role": "user", "content": question}],
                    "ability": "math",
                    "reward_model": {"style": "rule", "ground_truth": str(entry["answer"])},
                    "extra_info": {"split": split, "index": len(out)},
                    "solution": str(entry["answer"])})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "data"))
    parser.add_argument("--train", type=int, default=2000)
    parser.add_argument("--test", type=int, default=100)
    parser.add_argument("--sft", type=int, default=200, help="demonstrations, from the end of the train split")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    test = rows("test", TEST_SEED, args.test, set())
    train = rows("train", 0, args.train, {r["prompt"][0]["content"] for r in test})
    for name, table in (("train", train), ("test", test)):
        tmp = out / f".{name}.parquet.tmp"
        pq.write_table(pa.Table.from_pylist(table), tmp)
        tmp.replace(out / f"{name}.parquet")
    demos = [{"messages": r["prompt"] + [{"role": "assistant", "content": f"\\boxed{{{r['solution']}}}"}]}
             for r in train[-args.sft:]]
    tmp = out / ".sft.jsonl.tmp"
    tmp.write_text("".join(json.dumps(d) + "\n" for d in demos))
    tmp.replace(out / "sft.jsonl")
    print(f"{out}: train {len(train)}, test {len(test)}, sft {len(demos)} rows")


if __name__ == "__main__":
    main()
