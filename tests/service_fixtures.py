"""The policy service as the tests start it: a real PolicyService on uvicorn at 127.0.0.1 (ServerThread),
and the real `openai` client on it.

    with serving(policy, fixed_resolver("base", None), ServiceConfig(batch_window_s=0.05)) as service:
        client_of(service, episode="ep-1").chat.completions.create(model="base", messages=[...])

    with broken_service(policy) as url:   # a model whose adapter cannot be loaded: generation fails
        ...
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import openai

from stages.service.app import ServerThread, build_app
from stages.service.resolve import fixed_resolver
from stages.service.service import PolicyService, ServiceConfig


@contextmanager
def serving(policy: Any, resolver: tuple[Callable, Any], config: ServiceConfig | None = None) -> Iterator[PolicyService]:
    """A PolicyService over `policy` (`resolver`: what fixed_resolver or catalog_resolver return) on a
    free 127.0.0.1 port; `.url` is its base URL. The service is closed on exit."""
    resolve, names = resolver
    service = PolicyService(policy, resolve, config or ServiceConfig(), names)
    try:
        with ServerThread(build_app(service)) as url:
            service.url = url
            yield service
    finally:
        service.close()


@contextmanager
def broken_service(policy: Any) -> Iterator[str]:
    """The base URL of a service whose one model, "broken", names an adapter folder that does not exist:
    each request for it fails inside generation (after a stream started, for a streamed one)."""
    with serving(policy, fixed_resolver("broken", "/nonexistent/adapter"), ServiceConfig(batch_window_s=0.0)) as service:
        yield service.url


def client_of(service: PolicyService, episode: str | None = None, base: str = "/v1") -> openai.OpenAI:
    """The real openai client on a service, recording under `episode` (X-Episode-Id) when given."""
    headers = {"X-Episode-Id": episode} if episode else {}
    return openai.OpenAI(base_url=service.url + base, api_key="unused", default_headers=headers, max_retries=0)
