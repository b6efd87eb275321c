"""`rlops ui`: the Prefect and MLflow UIs opened on a workspace, checked in headless Chromium, on the
views' shared run (tests/flows/views/conftest.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from bs4 import BeautifulSoup

from storage.workspace import Workspace
from tests.flows.views.conftest import RUN, cli, dump_dom, needs_chromium
from tests.processes import free_port, start_server, stop

# The shared run takes minutes on 2 cores: one xdist worker sets it up for all three modules (--dist loadgroup).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("views_run")]


def _serve(argv: list[str], env: dict[str, str], port: int, ready_path: str) -> subprocess.Popen:
    """Start a UI server (its own session, so it stops with its children) and wait until it answers."""
    return start_server(argv, f"http://127.0.0.1:{port}{ready_path}", status=200, timeout=240, env=env, every=1.0)


def _serve_ui(ws: Workspace, tool: str, ready_path: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_HOME")}
    argv = [sys.executable, "-m", "flows.cli", "ui", tool, "--port", str(port), "--workspace", str(ws.root)]
    return _serve(argv, env, port, ready_path), port


def _prefect_page(url: str) -> tuple[str, str]:
    """(the page's text, the text of its toasts) as Chromium rendered them."""
    dom = BeautifulSoup(dump_dom(url, budget_ms=20000), "html.parser")
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
        stop(proc)
    assert name in text and "rlops-train" in text and "Completed" in text
    assert toasts == ""

    # The control: the same server without PREFECT_UI_API_URL (the README's old advice on another
    # port) shows the error toast and not the run, so the checks above can tell the two apart.
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_UI_API_URL")}
    env.update(PREFECT_HOME=str(run_ws.root / "prefect"), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    proc = _serve([str(Path(sys.executable).parent / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                  env, port, "/api/health")
    try:
        text, toasts = _prefect_page(f"http://127.0.0.1:{port}/runs/flow-run/{flow_run}")
    finally:
        stop(proc)
    assert name not in text and "Can't connect to Server API" in toasts


@needs_chromium
def test_mlflow_ui_shows_the_run(run_ws: Workspace) -> None:
    parent = run_ws.catalog.get_run(RUN)["mlflow_run_id"]
    experiment = run_ws.tracker.experiment_id
    proc, port = _serve_ui(run_ws, "mlflow", "/health")
    try:
        dom = BeautifulSoup(dump_dom(f"http://127.0.0.1:{port}/#/experiments/{experiment}/runs/{parent}", budget_ms=20000),
                            "html.parser")
        missing = BeautifulSoup(dump_dom(f"http://127.0.0.1:{port}/#/experiments/{experiment}/runs/{'0' * 32}",
                                          budget_ms=20000), "html.parser")
    finally:
        stop(proc)
    text = dom.get_text(" ")
    # the run page: its name, its tags and its curves' metric names
    assert f"pipeline:{RUN}" in text and "rlops.final_model_id" in text and "heldout/accuracy" in text
    assert f"pipeline:{RUN}" not in missing.get_text(" ")  # the control: an unknown run shows no such page


def test_ui_print_gives_the_one_line_to_run(run_ws: Workspace) -> None:
    out = cli(run_ws.root, "ui", "prefect", "--port", "4300", "--print")
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip()
    assert f"PREFECT_HOME={run_ws.root / 'prefect'}" in line and "PREFECT_UI_API_URL=http://127.0.0.1:4300/api" in line
    assert line.endswith("server start --host 127.0.0.1 --port 4300")
    out = cli(run_ws.root, "ui", "mlflow", "--print")
    assert out.returncode == 0 and f"sqlite:///{run_ws.root / 'mlflow.db'}" in out.stdout
    out = cli(run_ws.root / "empty", "ui", "prefect", "--print")
    assert out.returncode == 1 and "no Prefect database" in out.stderr
