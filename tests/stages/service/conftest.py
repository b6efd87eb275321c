"""The served scripted model shared by the protocol tests (streaming, Responses, URLs and fields):
one resident policy per session, one service on uvicorn per module. test_service.py keeps its own."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from stages.policy.resident import ResidentPolicy
from stages.service.app import ServerThread, build_app
from stages.service.resolve import fixed_resolver
from stages.service.service import PolicyService, ServiceConfig
from tests.scripted_model import scripted_model_dir  # noqa: F401


@pytest.fixture(scope="session")
def scripted_policy(scripted_model_dir: Path) -> ResidentPolicy:  # noqa: F811
    return ResidentPolicy.load(str(scripted_model_dir))


@pytest.fixture(scope="module")
def served(scripted_policy):
    """A service whose one model is "base"; `.url` is its base URL."""
    resolve, names = fixed_resolver("base", None)
    svc = PolicyService(scripted_policy, resolve, ServiceConfig(batch_window_s=0.05, default_max_tokens=40), names)
    with ServerThread(build_app(svc)) as url:
        svc.url = url
        yield svc
    svc.close()


def client_of(service: PolicyService, episode: str | None = None, base: str = "/v1") -> openai.OpenAI:
    """The real openai client on a service, recording under `episode` (X-Episode-Id) when given."""
    headers = {"X-Episode-Id": episode} if episode else {}
    return openai.OpenAI(base_url=service.url + base, api_key="unused", default_headers=headers, max_retries=0)
