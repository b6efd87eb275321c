"""Looking at what the agent did: `rlops inspect` (terminal and HTML), version diffs, the run page,
MLflow curves and models, and the Prefect and MLflow UIs opened on a workspace, in headless Chromium.

One real run serves every test (module fixture): `rlops run` on the tiny model with its temporary
Prefect server (state in the workspace), then `rlops retrain` with an edited reward and an added
judge-like reward (new versions to diff, explanations to show, a retrain branch), plus a batch of
hand-built tool-calling episodes (a random tiny model makes no tool calls). Model and tool text
carries `<script>alert(1)</script>` and rich markup, which must come out as text.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from bs4 import BeautifulSoup

from storage.workspace import Workspace
from tests.flows.conftest import tiny_config

pytestmark = pytest.mark.slow  # the shared run takes a few minutes on 2 cores

RUN = "insp"
XSS = "<script>alert(1)</script>"
MARKUP = "[bold red]not markup[/bold red]"
JUDGE = '''
from rewards.base import reward


@reward(low=0.0, high=1.0)
def judged(rollout):
    """A stand-in for a judge: a value and an explanation that quotes model output."""
    text = rollout.messages[-1].content or ""
    return float(len(text) % 2), {"explanation": f"the answer <b>{text[:12]}</b> has {len(text)} characters"}
'''


def _cli(ws: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_HOME")}
    return subprocess.run([sys.executable, "-m", "flows.cli", *args, "--workspace", str(ws)], env=env,
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
    for g in range(2):
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


@pytest.fixture(scope="module")
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
    out = _cli(ws_dir, "run", str(tmp / "run.yaml"))
    assert out.returncode == 0, out.stderr[-3000:]

    judge_file = tmp / "judge_reward.py"
    judge_file.write_text(JUDGE)
    edited = json.loads(json.dumps(cfg))
    edited["score"]["rewards"][1]["params"]["limit"] = 2  # a new version of "short"
    edited["score"]["rewards"].append({"name": "judged", "fn": f"{judge_file}:judged", "weight": 0.0})
    (tmp / "edited.yaml").write_text(yaml.safe_dump(edited))
    ws = Workspace.open(ws_dir)
    sft = next(c["policy_id"] for c in ws.catalog.checkpoints(RUN) if c["kind"] == "sft")
    out = _cli(ws_dir, "retrain", str(tmp / "edited.yaml"), "--run", RUN, "--from", sft)
    assert out.returncode == 0, out.stderr[-3000:]
    _tool_run(ws, tiny_model_dir, judge_file)
    return ws


def _soup(path: Path) -> BeautifulSoup:
    return BeautifulSoup(path.read_text(), "html.parser")


def _scores(ws: Workspace, run: str, name: str) -> dict[str, dict[str, float | None]]:
    """version -> rollout id -> value over the run's training batches, computed here independently."""
    rows = ws.query(
        "SELECT w.reward_version, w.rollout_id, w.value FROM rewards w JOIN stage_runs s ON s.artifact_id = w.batch_id "
        f"JOIN artifacts a ON a.artifact_id = w.batch_id WHERE s.stage = 'rollout' AND s.run_name = '{run}' "
        f"AND a.meta->>'split' = 'train' AND w.reward_name = '{name}'").to_pylist()
    out: dict[str, dict[str, float | None]] = {}
    for r in rows:
        out.setdefault(r["reward_version"], {})[r["rollout_id"]] = r["value"]
    return out


def _expected_ends(values: dict[str, float | None], top: int) -> tuple[list[str], list[str]]:
    scored = [(v, r) for r, v in values.items() if v is not None]
    best = [r for _, r in sorted(scored, key=lambda p: (-p[0], p[1]))[:top]]
    worst = [r for _, r in sorted(scored, key=lambda p: (p[0], [-ord(c) for c in p[1]]))][: min(top, len(scored) - len(best))]
    return best, worst


# -- inspect -------------------------------------------------------------------------------


def test_html_shows_the_best_and_worst_episodes_per_version_in_order(run_ws: Workspace) -> None:
    from flows.views.inspection import inspect_run
    from flows.views.inspect_render import write_inspection_html

    view = inspect_run(run_ws, RUN, "short", top=2)
    page = _soup(write_inspection_html(view, run_ws.root / "t" / "short.html"))
    expected = _scores(run_ws, RUN, "short")
    assert len(expected) == 2  # the run's version and the retrain's edited one
    sections = page.select("section.ranking")
    assert [s["data-reward"] for s in sections] == [r.reward for r in view.rankings]
    assert {s["data-reward"] for s in sections} == {f"short@{v}" for v in expected}
    for section in sections:
        values = expected[section["data-reward"].split("@")[1]]
        best, worst = _expected_ends(values, 2)
        episodes = section.select("article.episode")
        assert [e["data-rollout-id"] for e in episodes] == best + worst
        assert [e["data-rank"] for e in episodes] == ["top 1", "top 2", "bottom 1", "bottom 2"][: len(best) + len(worst)]
        shown = [float(e["data-value"]) for e in episodes]
        assert shown == [values[r] for r in best + worst]
        assert shown[: len(best)] == sorted(shown[: len(best)], reverse=True)
        assert shown[len(best):] == sorted(shown[len(best):])
        # the ranking table lists the same episodes in the same order
        assert [tr["data-rollout-id"] for tr in section.select("table.rewards tr[data-rollout-id]")] == best + worst


def test_every_reward_column_and_row_is_shown(run_ws: Workspace) -> None:
    from flows.views.inspection import inspect_run
    from flows.views.inspect_render import write_inspection_html

    page = _soup(write_inspection_html(inspect_run(run_ws, RUN, top=1), run_ws.root / "t" / "total.html"))
    refs = {f"{name}@{v}" for name in ("correct", "short", "total", "judged") for v in _scores(run_ws, RUN, name)}
    assert len(refs) == 6  # correct, judged: one version each; short and total: two each
    first = page.select("section.ranking")[0]
    header = [th.get_text() for th in first.select("table.rewards tr")[0].find_all("th")]
    assert header[:4] == ["rank", "episode", "step", first["data-reward"]] and set(header[3:]) == refs
    for article in page.select("article.episode"):
        rid = article["data-rollout-id"]
        stored = run_ws.query(f"SELECT reward_name || '@' || reward_version AS ref, value FROM rewards "
                              f"WHERE rollout_id = '{rid}'").to_pylist()
        shown = {tr["data-reward"]: tr.find_all("td")[1].get_text() for tr in article.select("tr.score")}
        assert set(shown) == {r["ref"] for r in stored}
        assert all(float(shown[r["ref"]]) == pytest.approx(r["value"], rel=1e-3) for r in stored)
        assert article.select_one(".explanation").get_text().startswith("judge (judged@")  # the judge-like reward
        # sampled/masked split: the highlighted runs are exactly the loss-mask-1 tokens
        mask = run_ws.query(f"SELECT loss_mask FROM rollouts WHERE rollout_id = '{rid}'").to_pylist()[0]["loss_mask"]
        spans = article.select("details.tokens span")
        assert sum(int(s["title"].split()[0]) for s in spans if "sampled" in s["class"]) == sum(mask)
        assert sum(int(s["title"].split()[0]) for s in spans) == len(mask)
        roles = [d.select_one(".role").get_text() for d in article.select(".msg")]
        assert roles[:2] == ["system", "user"] and roles[-1] == "assistant"


def test_model_text_is_escaped(run_ws: Workspace) -> None:
    from flows.views.inspection import inspect_run
    from flows.views.inspect_render import write_inspection_html

    path = write_inspection_html(inspect_run(run_ws, "tools", "judged", top=3), run_ws.root / "t" / "tools.html")
    raw = path.read_text()
    page = _soup(path)
    assert XSS not in raw and "&lt;script&gt;alert(1)&lt;/script&gt;" in raw
    scripts = page.find_all("script")
    assert len(scripts) == 1 and "alert" not in scripts[0].get_text()  # only the page's own script
    assert not page.select("article b") or all(b.get_text().startswith("judge (") for b in page.select("article b"))
    text = page.get_text()
    assert XSS in text and MARKUP in text and "the answer <b>" in text  # shown as text, verbatim
    # tool calls and tool results are part of the conversation
    first = page.select_one("article.episode")
    calls = [c.get_text() for c in first.select(".tool-call")]
    assert calls[0].startswith('→ search({"query": "Vexhollow founded"})') and calls[1].startswith("→ read(")
    tool_msgs = first.select(".msg.role-tool")
    assert "result of call_0_0" in tool_msgs[0].select_one(".role").get_text()
    assert XSS in tool_msgs[0].select_one("pre").get_text()


def test_terminal_view_through_the_cli(run_ws: Workspace) -> None:
    out = _cli(run_ws.root, "inspect", "tools", "--reward", "correct", "--top", "1", "--tokens")
    assert out.returncode == 0, out.stderr
    best, worst = _expected_ends(next(iter(_scores(run_ws, "tools", "correct").values())), 1)
    text = out.stdout
    assert text.index(best[0]) < text.index(worst[0])
    assert "top 1 of correct@" in text and "bottom 1 of correct@" in text
    assert "tool call call_0_0: search(" in text and "judge (judged@" in text and "tokens:" in text
    assert MARKUP in text and XSS in text  # rich printed them as text, not as markup

    out = _cli(run_ws.root, "inspect", RUN, "--step", "1", "--format", "html", "--top", "1")
    assert out.returncode == 0, out.stderr
    page = Path(out.stdout.strip().splitlines()[-1])
    assert page == run_ws.root / "reports" / RUN / "inspect" / "total-step1.html"
    batch = set(next(c for c in run_ws.catalog.checkpoints(RUN) if c["step"] == 1)["trained_on"]["batches"])
    shown = [a["data-rollout-id"] for a in _soup(page).select("article.episode")]
    assert shown
    assert {run_ws.query(f"SELECT batch_id FROM rollouts WHERE rollout_id = '{r}'").to_pylist()[0]["batch_id"]
            for r in shown} == batch


@pytest.mark.parametrize("args, message", [
    (["nope"], "run 'nope' has no training rollout batches"),
    (["insp", "--reward", "missing"], "no 'missing' rewards on run 'insp'"),
    (["insp", "--reward", "short@0000"], "short@0000 was not scored"),
    (["insp", "--step", "9"], "no training batch at GRPO step 9 (steps: [1, 2])"),
    (["insp", "--diff", "short", "short@x"], "--diff takes two NAME@VERSION"),
    (["insp", "--top", "0"], "--top must be at least 1"),
])
def test_bad_input_is_a_clear_error(run_ws: Workspace, args: list[str], message: str) -> None:
    out = _cli(run_ws.root, "inspect", *args)
    assert out.returncode == 1 and message in out.stderr, out.stderr
    assert not out.stdout


# -- version diffs ---------------------------------------------------------------------------


def test_diff_shows_the_largest_changes_side_by_side(run_ws: Workspace) -> None:
    versions = list(_scores(run_ws, RUN, "short").items())
    (va, before), (vb, after) = sorted(versions, key=lambda kv: run_ws.query(
        f"SELECT min(scored_at) AS t FROM rewards WHERE reward_version = '{kv[0]}'").to_pylist()[0]["t"])
    a, b = f"short@{va}", f"short@{vb}"
    changed = {r: after[r] - before[r] for r in before if before[r] != after[r]}
    assert changed  # limit 8 -> 2 changes the length penalty of non-empty answers

    out = _cli(run_ws.root, "inspect", RUN, "--diff", a, b, "--top", "3", "--format", "html")
    assert out.returncode == 0, out.stderr
    page = _soup(Path(out.stdout.strip().splitlines()[-1]))
    assert f"{len(changed)} of {len(before)} episodes" in page.get_text()
    articles = page.select("article.change")
    expected = sorted(changed, key=lambda r: (-abs(changed[r]), r))[:3]
    assert [x["data-rollout-id"] for x in articles] == expected
    for x in articles:
        rid = x["data-rollout-id"]
        assert float(x["data-before"]) == before[rid] and float(x["data-after"]) == after[rid]
        left, right = x.select(".side > div")
        assert left.select_one("tr.score")["data-reward"] == a and right.select_one("tr.score")["data-reward"] == b

    text = _cli(run_ws.root, "inspect", RUN, "--diff", a, b, "--top", "1")
    assert text.returncode == 0 and expected[0] in text.stdout and f"{len(changed)} of {len(before)}" in text.stdout


# -- MLflow ------------------------------------------------------------------------------------


def test_mlflow_curves_tags_and_models(run_ws: Workspace) -> None:
    import mlflow
    from mlflow import MlflowClient

    client = MlflowClient(run_ws.settings.mlflow_uri)
    parent = run_ws.catalog.get_run(RUN)["mlflow_run_id"]
    grpo = [c for c in run_ws.catalog.checkpoints(RUN) if c["kind"] == "grpo"]
    assert [c["step"] for c in grpo] == [1, 2]

    for name, key in [("train/reward_mean", "reward_mean"), ("train/reward_std", "reward_std"),
                      ("train/zero_variance_share", "frac_zero_variance_groups"), ("train/loss", "loss"),
                      ("train/tokens_per_s", "tokens_per_s"), ("train/clip_frac", "clip_frac")]:
        history = sorted(client.get_metric_history(parent, name), key=lambda m: m.step)
        stored = [(c["step"], run_ws.catalog.get_artifact(c["policy_id"])["meta"]["metrics"].get(key)) for c in grpo]
        # a step whose groups all had zero variance trained nothing: no loss, clip fraction or speed
        assert [(m.step, m.value) for m in history] == [(s, pytest.approx(v)) for s, v in stored if v is not None], name
        if key.startswith(("reward", "frac")):
            assert len(history) == 2
    sft = next(c for c in run_ws.catalog.checkpoints(RUN) if c["kind"] == "sft")
    heldout = sorted(client.get_metric_history(parent, "heldout/accuracy"), key=lambda m: m.step)
    evals = {r["policy_id"]: r["value"] for r in run_ws.query(
        "SELECT policy_id, value FROM evals WHERE metric = 'accuracy'").to_pylist()}
    assert [(m.step, m.value) for m in heldout] == [(0, evals[sft["policy_id"]])] + [(c["step"], evals[c["policy_id"]]) for c in grpo]
    assert [m.step for m in client.get_metric_history(parent, "heldout_base/accuracy")] == [0]

    for c in grpo:  # each GRPO child run names the reward version it trained on
        assert client.get_run(c["mlflow_run_id"]).data.tags["rlops.reward"] == c["trained_on"]["reward"]

    models = {m.tags["rlops.policy_id"]: m for m in client.search_logged_models([client.get_run(parent).info.experiment_id])}
    final = grpo[-1]
    assert set(models) >= {sft["policy_id"], *(c["policy_id"] for c in grpo)}  # mlflow_models: all
    model = models[final["policy_id"]]
    assert client.get_run(parent).data.tags["rlops.final_model_id"] == model.model_id
    assert model.source_run_id == final["mlflow_run_id"]
    assert model.tags["rlops.lineage"].split(" -> ") == [sft["parent_id"], sft["policy_id"], grpo[0]["policy_id"],
                                                         final["policy_id"]]
    assert model.tags["rlops.reward"] == final["trained_on"]["reward"] and model.tags["rlops.step"] == "2"
    local = Path(mlflow.artifacts.download_artifacts(artifact_uri=model.artifact_location, tracking_uri=client.tracking_uri))
    files = {p.name for p in local.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json"} <= files and "optimizer.pt" not in files
    assert (local / "adapter_model.safetensors").read_bytes() == (Path(final["adapter_uri"]) / "adapter_model.safetensors").read_bytes()

    # the retrain branch (`rlops retrain`) has its own parent run, curves and final model
    branch = run_ws.catalog.get_run(f"{RUN}-retrain")
    replayed = run_ws.catalog.checkpoints(f"{RUN}-retrain")
    history = sorted(client.get_metric_history(branch["mlflow_run_id"], "train/reward_mean"), key=lambda m: m.step)
    assert [(m.step, m.value) for m in history] == [
        (c["step"], pytest.approx(run_ws.catalog.get_artifact(c["policy_id"])["meta"]["metrics"]["reward_mean"]))
        for c in replayed]
    tags = client.get_run(branch["mlflow_run_id"]).data.tags
    assert client.get_logged_model(tags["rlops.final_model_id"]).tags["rlops.policy_id"] == replayed[-1]["policy_id"]


# -- the run page and the report -------------------------------------------------------------


def test_report_links_the_run_page_which_shows_curves_evals_lineage_and_episodes(run_ws: Workspace) -> None:
    from flows.views.report import write_report

    index = write_report(run_ws, RUN)
    links = {a["href"] for a in _soup(index).select("ul.pages a")}
    assert "run.html" in links and "inspect/total.html" in links
    page = _soup(index.parent / "run.html")

    titles = [svg["aria-label"] for svg in page.select("svg.chart")]
    assert titles[0] == "train reward (mean ± std)" and "loss" in titles and "held-out metrics by step" in titles
    reward_points = page.select("svg.chart")[0].find_all("circle")
    grpo = [c for c in run_ws.catalog.checkpoints(RUN) if c["kind"] == "grpo"]
    assert len(reward_points) == len(grpo)

    chain = [c["policy_id"] for c in run_ws.catalog.checkpoints(RUN)]
    base = run_ws.catalog.get_checkpoint(chain[0])["parent_id"]
    assert [li["data-policy-id"] for li in page.select("ol.lineage li")] == [base, *chain]
    assert [tr["data-policy-id"] for tr in page.select("table.heldout tr[data-policy-id]")] == [base, *chain]
    branch = [c["policy_id"] for c in run_ws.catalog.checkpoints(f"{RUN}-retrain")]
    assert [li["data-policy-id"] for li in page.select("ol.branch li")] == branch and len(branch) == 2

    hrefs = [a["href"] for a in page.select("ul.inspect-links a")]
    assert hrefs[:3] == ["inspect/total.html", "inspect/total-step1.html", "inspect/total-step2.html"]
    assert all((index.parent / h).exists() for h in hrefs)


def test_run_page_of_a_run_without_grpo_steps(tmp_path: Path, tiny_model_dir: Path) -> None:
    from flows import pipeline
    from flows.run_config import from_dict
    from flows.views.runpage import write_run_page
    from stages.common import StageContext

    cfg = tiny_config(tiny_model_dir, name="zero", steps=0)
    cfg.update(sft=None, eval={"n_prompts": 1, "every": 1, "metric": "correct"})
    ws = Workspace.open(tmp_path / "ws")
    ws.catalog.upsert_run("zero", cfg, None, "complete")
    result = pipeline.train(from_dict(cfg), StageContext(ws, run_name="zero"))
    page = _soup(write_run_page(ws, "zero"))
    assert [tr["data-policy-id"] for tr in page.select("table.heldout tr[data-policy-id]")] == [result.base]
    assert not page.select("ul.inspect-links li")  # nothing trained, so no training episodes to link


# -- in a real browser -----------------------------------------------------------------------

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (make test installs it: apt-get install chromium)")


def _dump_dom(url: str, budget_ms: int = 5000) -> str:
    out = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                          "--no-first-run", f"--virtual-time-budget={budget_ms}", "--dump-dom", url],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@needs_chromium
def test_pages_run_in_chromium(run_ws: Workspace) -> None:
    from flows.views.inspection import diff_versions, inspect_run
    from flows.views.inspect_render import write_diff_html, write_inspection_html
    from flows.views.runpage import write_run_page

    run_page = write_run_page(run_ws, RUN)
    tools = write_inspection_html(inspect_run(run_ws, "tools", "judged", top=3), run_ws.root / "t" / "tools-browser.html")
    a, b = (r.reward for r in inspect_run(run_ws, RUN, "short", top=1).rankings)
    diff = write_diff_html(diff_versions(run_ws, RUN, a, b), run_ws.root / "t" / "diff-browser.html")
    for path in (run_page, tools, diff, run_page.parent / "inspect" / "total.html"):
        dom = BeautifulSoup(_dump_dom(path.as_uri()), "html.parser")
        assert dom.html.get("data-ready") == "1" and dom.html.get("data-js-error") is None, path
    dom = BeautifulSoup(_dump_dom(tools.as_uri()), "html.parser")
    assert len(dom.select("article.episode")) == 6  # 3 best + 3 worst of 6
    assert len(dom.find_all("script")) == 1 and XSS in dom.get_text()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(argv: list[str], env: dict[str, str], port: int, ready_path: str) -> subprocess.Popen:
    """Start a UI server (its own session, so it stops with its children) and wait until it answers."""
    import httpx

    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 240
    while True:
        assert proc.poll() is None, f"{argv[:4]} exited with {proc.returncode}"
        try:
            if httpx.get(f"http://127.0.0.1:{port}{ready_path}", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{argv[:4]} did not come up"
        time.sleep(1)


def _serve_ui(ws: Workspace, tool: str, ready_path: str) -> tuple[subprocess.Popen, int]:
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_HOME")}
    argv = [sys.executable, "-m", "flows.cli", "ui", tool, "--port", str(port), "--workspace", str(ws.root)]
    return _serve(argv, env, port, ready_path), port


def _stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _prefect_page(url: str) -> tuple[str, str]:
    """(the page's text, the text of its toasts) as Chromium rendered them."""
    dom = BeautifulSoup(_dump_dom(url, budget_ms=20000), "html.parser")
    return dom.get_text(" "), " ".join(t.get_text(" ") for t in dom.select(".p-toast-container")).strip()


@needs_chromium
def test_prefect_ui_shows_the_run(run_ws: Workspace) -> None:
    import httpx

    flow_run = run_ws.query(f"SELECT prefect_flow_run_id AS id FROM stage_runs WHERE run_name = '{RUN}' "
                            "AND prefect_flow_run_id IS NOT NULL LIMIT 1").to_pylist()[0]["id"]
    proc, port = _serve_ui(run_ws, "prefect", "/api/health")
    try:
        name = httpx.get(f"http://127.0.0.1:{port}/api/flow_runs/{flow_run}").json()["name"]
        text, toasts = _prefect_page(f"http://127.0.0.1:{port}/runs/flow-run/{flow_run}")
    finally:
        _stop(proc)
    assert name in text and "rlops-train" in text and "Completed" in text
    assert toasts == ""

    # The control: the same server without PREFECT_UI_API_URL (the README's old advice on another
    # port) shows the error toast and not the run, so the checks above can tell the two apart.
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_UI_API_URL")}
    env.update(PREFECT_HOME=str(run_ws.root / "prefect"), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    proc = _serve([str(Path(sys.executable).parent / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                  env, port, "/api/health")
    try:
        text, toasts = _prefect_page(f"http://127.0.0.1:{port}/runs/flow-run/{flow_run}")
    finally:
        _stop(proc)
    assert name not in text and "Can't connect to Server API" in toasts


@needs_chromium
def test_mlflow_ui_shows_the_run(run_ws: Workspace) -> None:
    parent = run_ws.catalog.get_run(RUN)["mlflow_run_id"]
    experiment = run_ws.tracker.experiment_id
    proc, port = _serve_ui(run_ws, "mlflow", "/health")
    try:
        dom = BeautifulSoup(_dump_dom(f"http://127.0.0.1:{port}/#/experiments/{experiment}/runs/{parent}", budget_ms=20000),
                            "html.parser")
        missing = BeautifulSoup(_dump_dom(f"http://127.0.0.1:{port}/#/experiments/{experiment}/runs/{'0' * 32}",
                                          budget_ms=20000), "html.parser")
    finally:
        _stop(proc)
    text = dom.get_text(" ")
    # the run page: its name, its tags and its curves' metric names
    assert f"pipeline:{RUN}" in text and "rlops.final_model_id" in text and "heldout/accuracy" in text
    assert f"pipeline:{RUN}" not in missing.get_text(" ")  # the control: an unknown run shows no such page


def test_ui_print_gives_the_one_line_to_run(run_ws: Workspace) -> None:
    out = _cli(run_ws.root, "ui", "prefect", "--port", "4300", "--print")
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip()
    assert f"PREFECT_HOME={run_ws.root / 'prefect'}" in line and "PREFECT_UI_API_URL=http://127.0.0.1:4300/api" in line
    assert line.endswith("server start --host 127.0.0.1 --port 4300")
    out = _cli(run_ws.root, "ui", "mlflow", "--print")
    assert out.returncode == 0 and f"sqlite:///{run_ws.root / 'mlflow.db'}" in out.stdout
    out = _cli(run_ws.root / "empty", "ui", "prefect", "--print")
    assert out.returncode == 1 and "no Prefect database" in out.stderr
