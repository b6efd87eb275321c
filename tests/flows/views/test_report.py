"""The run page and the report, the pages in a real browser, and the MLflow curves and models they sit
beside, on the views' shared run (tests/flows/views/conftest.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from bs4 import BeautifulSoup

from rewards.drift import drift as drift_measures
from storage.workspace import Workspace
from tests.flows.conftest import tiny_config
from tests.flows.views.conftest import RUN, XSS, dump_dom, needs_chromium, soup

# The shared run takes minutes on 2 cores: one xdist worker sets it up for all three modules (--dist loadgroup).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("views_run")]


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

    # the judge's drift (a group reward against each programmatic one, rewards/drift.py): a curve per step, the same
    # numbers as the `judge_drift` view and as the measures recomputed from the stored rewards
    drift = run_ws.query("SELECT * FROM judge_drift WHERE run_name = ?", [f"{RUN}-retrain"]).to_pylist()
    assert {(r["judge"], r["truth"]) for r in drift} == {("judged", "correct"), ("judged", "short")}
    degenerate = sorted(client.get_metric_history(branch["mlflow_run_id"], "judge/judged.degenerate_groups"),
                        key=lambda m: m.step)
    assert [m.step for m in degenerate] == [c["step"] for c in replayed]
    for c, point in zip(replayed, degenerate):
        (batch,) = c["trained_on"]["batches"]
        rows = run_ws.query("SELECT r.reward_name, r.value, ro.group_id FROM rewards r JOIN rollouts ro USING (rollout_id) "
                            "WHERE ro.batch_id = ? AND r.reward_name IN ('judged', 'correct') ORDER BY r.rollout_id",
                            [batch]).to_pylist()
        values = {n: [r["value"] for r in rows if r["reward_name"] == n] for n in ("judged", "correct")}
        groups = [r["group_id"] for r in rows if r["reward_name"] == "judged"]
        expected = drift_measures(values["judged"], values["correct"], groups)
        assert point.value == pytest.approx(expected["degenerate_groups"])
        (row,) = [r for r in drift if r["truth"] == "correct" and batch in r["batches"]]
        assert row["pairs"] == expected["pairs"] and row["degenerate_groups"] == pytest.approx(point.value)


# -- the run page and the report -------------------------------------------------------------


def test_report_links_the_run_page_which_shows_curves_evals_lineage_and_episodes(run_ws: Workspace) -> None:
    from flows.views.report import write_report

    index = write_report(run_ws, RUN)
    links = {a["href"] for a in soup(index).select("ul.pages a")}
    assert "run.html" in links and "inspect/total.html" in links
    page = soup(index.parent / "run.html")

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
    page = soup(write_run_page(ws, "zero"))
    assert [tr["data-policy-id"] for tr in page.select("table.heldout tr[data-policy-id]")] == [result.base]
    assert not page.select("ul.inspect-links li")  # nothing trained, so no training episodes to link


# -- in a real browser -----------------------------------------------------------------------


@needs_chromium
def test_pages_run_in_chromium(run_ws: Workspace) -> None:
    from flows.views.inspect_render import write_diff_html, write_inspection_html
    from flows.views.inspection import diff_versions, inspect_run
    from flows.views.runpage import write_run_page

    run_page = write_run_page(run_ws, RUN)
    tools = write_inspection_html(inspect_run(run_ws, "tools", "judged", top=3), run_ws.root / "t" / "tools-browser.html")
    a, b = (r.reward for r in inspect_run(run_ws, RUN, "short", top=1).rankings)
    diff = write_diff_html(diff_versions(run_ws, RUN, a, b), run_ws.root / "t" / "diff-browser.html")
    for path in (run_page, tools, diff, run_page.parent / "inspect" / "total.html"):
        dom = BeautifulSoup(dump_dom(path.as_uri()), "html.parser")
        assert dom.html.get("data-ready") == "1" and dom.html.get("data-js-error") is None, path
    dom = BeautifulSoup(dump_dom(tools.as_uri()), "html.parser")
    assert len(dom.select("article.episode")) == 6  # 3 best + 3 worst of 6
    assert len(dom.find_all("script")) == 1 and XSS in dom.get_text()
