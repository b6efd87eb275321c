"""The pages show every update kind (issue 25): a short online `algorithm: dpo` and `algorithm: ppo` run puts
its `dpo`/`ppo` checkpoints in the run page's step chain, curves and held-out table with their own metrics
(DPO: TRL's reward accuracy and margin; PPO: policy and value loss, the critic's explained variance), in
`rlops inspect`'s steps, and on the MLflow parent run's curves."""

from __future__ import annotations

from pathlib import Path

import pytest
from bs4 import BeautifulSoup

from flows import pipeline
from flows.mlflow_log import TRAIN_CURVES, log_step
from flows.run_config import from_dict
from flows.views.inspection import inspect_run, run_batches
from flows.views.runpage import write_run_page
from stages.common import StageContext
from storage.workspace import Workspace
from tests.flows.test_async import async_config

OWN = {"dpo": {"rewards_accuracies": "DPO reward accuracy", "rewards_margins": "DPO reward margin"},
       "ppo": {"policy_loss": "PPO policy loss", "value_loss": "PPO value loss",
               "explained_variance": "PPO critic's explained variance"}}


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["dpo", "ppo"])
def test_run_page_inspect_and_mlflow_show_dpo_and_ppo_steps(tmp_path: Path, tiny_model_dir: Path, algorithm: str) -> None:
    steps = 2
    data = async_config(tiny_model_dir, algorithm, k=0, steps=steps)  # a reward with signal: DPO gets pairs
    data.pop("grpo")
    data.update(algorithm=algorithm, eval={**data["eval"], "every": 1})
    cfg = from_dict(data)
    ws = Workspace.open(tmp_path / "ws")
    parent = ws.tracker.start_run(algorithm)
    rows: list[dict] = []
    result = pipeline.train(cfg, StageContext(ws, run_name=algorithm, parent_run_id=parent), on_step=rows.append)
    ws.catalog.upsert_run(algorithm, cfg.model_dump(mode="json"), parent, "complete")
    for row in rows:
        log_step(ws, parent, row, warm_started=False)

    kinds = [ws.catalog.get_checkpoint(p)["kind"] for p in result.policies]
    assert kinds == [algorithm] * steps
    metrics = [ws.catalog.get_artifact(p)["meta"]["metrics"] for p in result.policies]
    assert all(key in m for m in metrics for key in OWN[algorithm])  # the stage recorded its own metrics

    page = BeautifulSoup(write_run_page(ws, algorithm).read_text(), "html.parser")
    lineage = [li["data-policy-id"] for li in page.select("ol.lineage li")]
    assert lineage == [result.base, *result.policies]
    charts = {svg["aria-label"]: svg for svg in page.select("svg.chart")}
    for title in OWN[algorithm].values():
        (chart,) = [svg for label, svg in charts.items() if label.startswith(title)]
        assert "no data" not in chart.text and len(chart.select("title")) == steps  # a point per step
    assert not any(label.startswith("clip fraction") for label in charts)  # GRPO's chart: not recorded here
    heldout = [tr["data-policy-id"] for tr in page.select("table.heldout tr[data-policy-id]")]
    assert heldout == [result.base, *result.policies]
    held = charts["held-out metrics by step"]
    # a point at the start policy's step 0, then at every step's checkpoint
    assert {t.text.split(" at ")[1].split(":")[0] for t in held.select("title")} == {str(s) for s in range(steps + 1)}

    # `rlops inspect`: each training batch belongs to the step whose checkpoint trained on it.
    assert sorted(s for s in run_batches(ws, algorithm).values()) == list(range(1, steps + 1))
    assert inspect_run(ws, algorithm, step=steps, top=1).batches == [result.batches[-1]]

    # MLflow: the parent run carries a curve point per step for each of the algorithm's own metrics.
    for key in OWN[algorithm]:
        history = ws.tracker.client.get_metric_history(parent, TRAIN_CURVES[key])
        assert sorted(m.step for m in history) == list(range(1, steps + 1))
