"""tasks/openenv_app.py: an OpenEnv app's server process imports openenv-core's server package without Gradio
unless the web interface is switched on, and the app may still import Gradio itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = """
import json, sys
from tasks.openenv_app import env_server_without_gradio
hidden = env_server_without_gradio()
import openenv.core.env_server as server
seen = "gradio" in sys.modules
import gradio  # an app may use it: visible again
print(json.dumps({"hidden": hidden, "gradio_by_server": seen, "web_interface": server.create_web_interface_app is not None}))
"""


@pytest.mark.parametrize("switch, expected", [
    (None, {"hidden": True, "gradio_by_server": False, "web_interface": False}),
    ("true", {"hidden": False, "gradio_by_server": True, "web_interface": True}),  # the web interface needs it
])
def test_the_env_server_package_comes_without_gradio_unless_the_web_interface_is_on(switch, expected):
    env = {k: v for k, v in os.environ.items() if k != "ENABLE_WEB_INTERFACE"}
    if switch:
        env["ENABLE_WEB_INTERFACE"] = switch
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == expected
