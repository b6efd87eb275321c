"""A verifiers environment learns: configs/verifiers.yaml (examples/verifiers_arith/arith_env.py, a SingleTurnEnv
with a two-function rubric) through `rlops run`, and its held-out `correct_answer` before (the base model) and
after (the final checkpoint), prompt by prompt, with the paired 95 % bootstrap interval of the difference.

    .ci/loopback .venv/bin/python bench/bench_verifiers.py [--workdir /tmp/rlops-bench-verifiers] [--report-only]

Recorded in docs/BENCHMARKS.md ("A verifiers environment learns").
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default="/tmp/rlops-bench-verifiers")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()
    workspace = Path(args.workdir) / "ws"
    if not args.report_only:
        subprocess.run([str(REPO / ".venv" / "bin" / "rlops"), "run", "configs/verifiers.yaml", "--workspace",
                        str(workspace)], check=True, cwd=REPO)

    from stages.evaluate import bootstrap_interval, by_prompt, latest_eval
    from storage.settings import Settings
    from storage.sql import open_views
    from storage.workspace import Workspace

    views = open_views(Settings.from_env(str(workspace)))
    started, finished = views.con.sql("SELECT min(started_at), max(finished_at) FROM runs").fetchall()[0]
    evals = views.con.sql("SELECT e.policy_id, coalesce(c.step, 0) AS step, e.value FROM evals e LEFT JOIN checkpoints c "
                          "USING (policy_id) WHERE e.metric = 'accuracy' ORDER BY e.created_at").fetchall()
    ws = Workspace.open(workspace)
    first, last = evals[0][0], evals[-1][0]
    before = {p: r["accuracy"] for p, r in by_prompt(ws, latest_eval(ws, first, None)).items()}
    after = {p: r["accuracy"] for p, r in by_prompt(ws, latest_eval(ws, last, None)).items()}
    diffs = [after[p] - before[p] for p in sorted(set(before) & set(after))]
    low, high = bootstrap_interval(diffs)
    print(json.dumps({"evals": [[s, round(v, 3)] for _, s, v in evals], "prompts": len(diffs),
                      "before": round(sum(before.values()) / len(before), 3),
                      "after": round(sum(after.values()) / len(after), 3),
                      "difference": [round(sum(diffs) / len(diffs), 3), round(low, 3), round(high, 3)],
                      "wall_s": round((finished - started).total_seconds(), 1)}))


if __name__ == "__main__":
    main()
