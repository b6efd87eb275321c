"""The served scripted model shared by the protocol tests (streaming, Responses, URLs and fields):
one resident policy per session, one service on uvicorn per module. test_service.py keeps its own."""

from __future__ import annotations

from pathlib import Path

import pytest

from stages.policy.resident import ResidentPolicy
from stages.service.resolve import fixed_resolver
from stages.service.service import ServiceConfig
from tests.scripted_model import scripted_model_dir  # noqa: F401
from tests.service_fixtures import serving


@pytest.fixture(scope="session")
def scripted_policy(scripted_model_dir: Path) -> ResidentPolicy:  # noqa: F811
    return ResidentPolicy.load(str(scripted_model_dir))


@pytest.fixture(scope="module")
def served(scripted_policy):
    """A service whose one model is "base"; `.url` is its base URL."""
    with serving(scripted_policy, fixed_resolver("base", None), ServiceConfig(batch_window_s=0.05, default_max_tokens=40)) as svc:
        yield svc
