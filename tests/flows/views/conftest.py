"""The views' shared run: one real pipeline run that every test of tests/flows/views/ reads.

`run_ws` (package scope, built once): `rlops run` on the tiny model with its temporary Prefect server
(state in the workspace), then `rlops retrain` with an edited reward and an added judge-like reward
(new versions to diff, explanations to show, a retrain branch) and the same retrain again (`--json`),
plus a batch of hand-built tool-calling episodes (a random tiny model makes no tool calls). Model and tool text carries
`<script>alert(1)</script>` and rich markup, which must come out as text. `rlops review`'s tests label the
"tools" run (and only label it: other tests read the same workspace).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from bs4 import BeautifulSoup

from storage.workspace import Workspace
from tests.browser import CHROMIUM
from tests.flows.conftest import tiny_config
from tests.processes import free_port, start_server, stop

RUN = "insp"
RETRAINED = "retrained.json"  # beside the workspace: what `rlops retrain` printed, and what came before it
XSS = "<script>alert(1)</script>"
MARKUP = "[bold red]not markup[/bold red]"
JUDGE = '''
from rewards.base import group_reward


@group_reward(low=0.0, high=1.0)
def judged(group):
    """A stand-in for a judge (a group reward, as RULER is): a value and an explanation that quotes model output."""
    out = []
    for rollout in group:
        text = rollout.messages[-1].content or ""
        out.append((float(len(text) % 2), {"explanation": f"the answer <b>{text[:12]}</b> has {len(text)} characters"}))
    return out
'''


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_HOME")}


def cli(ws: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args, "--workspace", str(ws)], env=_env(),
                          capture_output=True, text=True, timeout=timeout)


def _tool_run(ws: Workspace, model_dir: Path, judge_file: Path) -> None:
    """Run "tools": one hand-built training batch of tool-calling episodes (tests/factories.py), recorded
    as the rollout stage records its batches, then scored by the real score stage."""
    from stages import score
    from stages.common import StageContext, base_policy
    from storage.schema import Rollout, to_table
    from tests.factories import tool_episode

    policy = base_policy(ws, str(model_dir))
    episodes: list[Rollout] = []
    for g in range(4):  # 12 episodes: enough for the review page's test to grade 10 and order a group of 3
        for s in range(3):
            ep = tool_episode("ro-tools", g, s, answer="1987" if (g + s) % 2 else f"maybe 1986 {XSS}")
            ep.policy_id = policy
            ep.messages[3].content += f" {XSS} {MARKUP}"
            episodes.append(ep)
    ws.write_part("rollouts", "ro-tools", to_table(episodes), part="part-00000")
    ws.catalog.complete_artifact("ro-tools", "rollouts", "rollout", [policy], "h",
                                 meta={"step": 0, "split": "train", "policy_id": policy})
    ws.catalog.record_stage_run({"stage": "rollout", "artifact_id": "ro-tools", "inputs": [policy], "status": "complete",
                                 "run_name": "tools"})
    score_cfg = {"rewards": [{"name": "correct", "fn": "rewards.builtin.exact_match"},
                             {"name": "judged", "fn": f"{judge_file}:judged"}]}
    ws.catalog.upsert_run("tools", {"score": score_cfg}, None, "complete")
    score.run(score.ScoreConfig(**score_cfg), StageContext(ws, run_name="tools"), ["ro-tools"])


@pytest.fixture(scope="package")
def run_ws(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Workspace:
    tmp = tmp_path_factory.mktemp("inspect")
    ws_dir = tmp / "ws"
    data = tmp / "problems.jsonl"
    rows = [{"question": f"What is {a} + 1? {XSS} {MARKUP}", "answer": a + 1, "split": "train"} for a in range(10, 14)]
    rows += [{"question": f"What is {a} + 2?", "answer": a + 2, "split": "test"} for a in (50, 60)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = tiny_config(tiny_model_dir, name=RUN, steps=2)
    cfg["task"] = {"name": "arithmetic", "params": {"data_file": str(data)}}
    cfg["eval"]["n_prompts"] = 2
    cfg["mlflow_models"] = "all"
    (tmp / "run.yaml").write_text(yaml.safe_dump(cfg))
    out = cli(ws_dir, "run", str(tmp / "run.yaml"))
    assert out.returncode == 0, out.stderr[-3000:]

    judge_file = tmp / "judge_reward.py"
    judge_file.write_text(JUDGE)
    edited = json.loads(json.dumps(cfg))
    edited["score"]["rewards"][1]["params"]["limit"] = 2  # a new version of "short"
    edited["score"]["rewards"].append({"name": "judged", "fn": f"{judge_file}:judged", "weight": 0.0})
    (tmp / "edited.yaml").write_text(yaml.safe_dump(edited))
    ws = Workspace.open(ws_dir)
    sft = next(c["policy_id"] for c in ws.catalog.checkpoints(RUN) if c["kind"] == "sft")
    rollouts = ws.query("SELECT count(*) AS n FROM rollouts").to_pylist()[0]["n"]
    retrain = ("retrain", str(tmp / "edited.yaml"), "--run", RUN, "--from", sft)
    out = cli(ws_dir, *retrain)
    assert out.returncode == 0, out.stderr[-3000:]
    parent = ws.catalog.get_run(f"{RUN}-retrain")["mlflow_run_id"]  # the retrain's MLflow parent run
    again = cli(ws_dir, *retrain, "--json")  # a rerun: every stage found in the catalog
    assert again.returncode == 0, again.stderr[-3000:]
    (tmp / RETRAINED).write_text(json.dumps({"config": edited, "from": sft, "rollouts_before": rollouts,
                                             "mlflow_parent": parent, "stdout": out.stdout, "again": again.stdout}))
    _tool_run(ws, tiny_model_dir, judge_file)
    return ws


@pytest.fixture(scope="package")
def review_url(run_ws: Workspace) -> Iterator[str]:
    """`rlops review tools` serving the shared run's hand-built "tools" episodes on 127.0.0.1 (no token: loopback),
    with "alice" as the page's default reviewer; its base URL."""
    port = free_port()
    proc = start_server([sys.executable, "-m", "flows.cli", "review", "tools", "--workspace", str(run_ws.root),
                         "--port", str(port), "--reviewer", "alice"], f"http://127.0.0.1:{port}/api/health", status=200,
                        timeout=180, env=_env())
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)


def soup(path: Path) -> BeautifulSoup:
    return BeautifulSoup(path.read_text(), "html.parser")


needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (make test installs it: apt-get install chromium)")


def dump_dom(url: str, budget_ms: int = 5000) -> str:
    out = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                          "--no-first-run", f"--virtual-time-budget={budget_ms}", "--dump-dom", url],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout
