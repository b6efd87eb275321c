"""`rlops ui prefect|mlflow`: the UIs a user already knows, opened on a workspace.

`rlops run` without PREFECT_API_URL records its flow runs in a temporary Prefect server whose
database lives in `<workspace>/prefect` (flows/commands.py, `_prefect_env`). Its UI is a
`prefect server start` with PREFECT_HOME pointing there; on a port other than 4200 the UI must
also be told where its API is (PREFECT_UI_API_URL), or it calls 4200 and shows an error.
MLflow's UI reads the workspace's SQLite tracking database. `ui_command` builds either command
line with its environment (`--print` shows it, to run by hand); `serve` runs it until interrupted.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from storage.settings import Settings

DEFAULT_PORTS = {"prefect": 4200, "mlflow": 5000}


@dataclass(frozen=True)
class UICommand:
    argv: list[str]
    env: dict[str, str]  # set on top of the current environment
    url: str

    def shell(self) -> str:
        """The one line to run by hand."""
        return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in self.env.items()), *map(shlex.quote, self.argv)])


def _tool(name: str) -> str:
    # The console script installed next to this interpreter (the venv's), else the one on PATH.
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else name


def ui_command(tool: str, settings: Settings, host: str = "127.0.0.1", port: int | None = None) -> UICommand:
    """The command line and environment that open `tool`'s UI ("prefect" or "mlflow") on the workspace."""
    port = port or DEFAULT_PORTS[tool]
    url = f"http://{host}:{port}"
    if tool == "prefect":
        if os.environ.get("PREFECT_API_URL"):
            raise ValueError(f"PREFECT_API_URL is set ({os.environ['PREFECT_API_URL']}): runs went to that server; "
                             "open its UI instead")
        home = os.environ.get("PREFECT_HOME") or str(settings.prefect_home)  # where `rlops run` put them
        if not (Path(home) / "prefect.db").exists():
            raise KeyError(f"no Prefect database in {home}: no run has used the temporary Prefect server "
                           f"of this workspace yet (`rlops run CONFIG --workspace {settings.workspace}`)")
        return UICommand([_tool("prefect"), "server", "start", "--host", host, "--port", str(port)],
                         {"PREFECT_HOME": home, "PREFECT_UI_API_URL": f"{url}/api",
                          "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}, url)
    if tool == "mlflow":
        uri = settings.mlflow_uri
        if not uri.startswith("sqlite:///"):
            raise ValueError(f"MLflow tracks to {uri}: open that server's UI instead")
        if not Path(uri.removeprefix("sqlite:///")).exists():
            raise KeyError(f"no MLflow database at {uri.removeprefix('sqlite:///')}: nothing has been tracked yet")
        # One worker and no job runner (MLflow 3 starts ~7 huey processes for GenAI jobs): viewing runs
        # needs neither, and this machine's cores belong to training.
        return UICommand([_tool("mlflow"), "server", "--backend-store-uri", uri, "--host", host, "--port", str(port),
                          "--workers", "1"], {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}, url)
    raise ValueError(f"unknown UI {tool!r}: prefect or mlflow")


def serve(cmd: UICommand) -> int:
    """Run the UI server in the foreground until it exits or is interrupted (Ctrl-C)."""
    print(f"{cmd.url}  (stop with Ctrl-C)", file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd.argv, env={**os.environ, **cmd.env})
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        return proc.wait()
