"""A quiet console: rlops prints stage progress and one summary line per step; library noise goes to
`<workspace>/logs/rlops.log` or is silenced at its source.

What was noise in `make demo`: MLflow's INFO lines about its database, transformers' "Loading weights"
and datasets' per-map progress bars, Python warnings from libraries (deprecations, generation flags),
and TRL's per-step dicts (silenced where the SFT trainer is built: stages/sft.py). Python warnings are
not dropped: they are written, with their origin, to the log file, where a user debugging a run looks.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

# Read by the libraries at import time, so they are set before any stage imports them.
QUIET_ENV = {
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # transformers' "Loading weights" bar goes through huggingface_hub
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",  # datasets' map/filter bars while TRL prepares SFT data
    "TRANSFORMERS_VERBOSITY": "error",  # transformers' info/warning logs
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "MLFLOW_LOGGING_LEVEL": "WARNING",  # "Creating initial MLflow database tables..."
    "TOKENIZERS_PARALLELISM": "false",  # the fork warning of tokenizers in Ray workers and Prefect threads
    "VLLM_CONFIGURE_LOGGING": "0",  # vLLM's engine logs through the "vllm" logger below, not its own console handler
    "TORCH_CPP_LOG_LEVEL": "ERROR",  # C++ warnings on stderr (vLLM's CPU engine: "NUMA binding: Using MEMBIND ...")
}
# tasks.mcp: what stdio MCP servers write to stderr (their SDK logs every request), tasks/mcp.py
LIBRARY_LOGGERS = ("py.warnings", "transformers", "datasets", "trl", "peft", "accelerate", "torch", "ray",
                   "alembic", "httpx", "vllm", "tasks.mcp")
INFO_LOGGERS = ("tasks.mcp",)  # kept from INFO up: the root logger's WARNING would drop a server's log lines


def quiet_console(workspace: Path) -> Path:
    """Route library warnings and logs to `<workspace>/logs/rlops.log` (returned); set the libraries'
    own switches for their progress bars and chatter. A user's explicit settings (env) win."""
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    log = workspace / "logs" / "rlops.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(log, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logging.captureWarnings(True)  # warnings.warn -> the "py.warnings" logger
    for name in LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.propagate = False  # not to the root logger's console handler
    for name in INFO_LOGGERS:
        logging.getLogger(name).setLevel(logging.INFO)
    return log
