"""The process an OpenEnv app is served in when rlops starts it (tasks/openenv.py `AppServer`):

    python -m tasks.openenv_app examples.environments.guess_env:app --host 127.0.0.1 --port 8765

uvicorn's own command line (`python -m uvicorn ...`), after one thing. openenv-core's `env_server` package imports
its Gradio web interface whenever Gradio is installed (openenv-core depends on it), though a server builds that
interface only with `ENABLE_WEB_INTERFACE` set: measured, ~2 s of the ~3.5 s of CPU a server took to start, for
every environment server a run, a config check or a test starts. Without that switch the package is imported here
with Gradio hidden, so it takes the path it has for an install without Gradio (no web interface, which the switch
being off means anyway); Gradio is visible again before the app's own module is imported, so an app that uses it
still can. With the switch set, nothing is hidden. The client side (tasks/openenv.py: `GenericEnvClient` lives in the
same package) imports it the same way: a client never serves the web interface.
"""

from __future__ import annotations

import os
import sys

WEB_SWITCH_ON = ("true", "1", "yes")  # as openenv-core reads ENABLE_WEB_INTERFACE


def env_server_without_gradio() -> bool:
    """Import `openenv.core.env_server` with Gradio hidden, unless the web interface is switched on or Gradio is
    already imported; whether it was imported so."""
    if os.environ.get("ENABLE_WEB_INTERFACE", "false").lower() in WEB_SWITCH_ON or "gradio" in sys.modules:
        return False
    sys.modules["gradio"] = None  # type: ignore[assignment] - `import gradio` now raises ModuleNotFoundError
    try:
        import openenv.core.env_server  # noqa: F401
    except ImportError:  # a version that cannot do without it: the app imports the package again, with Gradio
        return False
    finally:
        del sys.modules["gradio"]
    return True


def main() -> None:
    env_server_without_gradio()
    import uvicorn

    uvicorn.main()  # its command line: the rest of sys.argv


if __name__ == "__main__":
    main()
