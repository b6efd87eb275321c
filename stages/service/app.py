"""The policy service over HTTP: the OpenAI-compatible FastAPI app and the uvicorn thread serving it.

    resolve, names = catalog_resolver(checkpoints_file, base)
    service = PolicyService(ResidentPolicy.load(base), resolve, names=names)
    with ServerThread(build_app(service)) as url:      # uvicorn on 127.0.0.1, a free port
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")

Endpoints: `POST /v1/chat/completions` (messages, tools, n, temperature, top_p, max_tokens, stop,
seed, logprobs, stream), `POST /v1/completions`, `POST /v1/responses` (stages/service/responses.py),
`GET /v1/models`, each also under `/ep/{episode_id}/v1/...`, and `GET /rlops/episodes/{id}` (an
episode's recorded tokens, assembled as a rollout). A call is recorded under the episode id of its
URL, else of its `X-Episode-Id` header, else of its `user` field (stages/service/service.py).

Errors are OpenAI-style JSON: 400 for a malformed request, a refused field (named in `param`, see
stages/service/schemas.py) or a prompt over the context, 404 for an unknown model, episode, stored
response or route, 500 (with the message, never a traceback) if generation fails; the server keeps
serving. A streamed request fails before its stream starts as such an error, during it with an
error event.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

from fastapi import Request  # at module level: FastAPI resolves handler annotations from module globals

from stages.service.responses import ResponsesAPI
from stages.service.schemas import ChatRequest, CompletionRequest, ResponsesRequest, UnsupportedField, error_body
from stages.service.service import PolicyService, ServiceError
from tasks.agent import EPISODE_HEADER  # its one home is the agent contract (external.py imports it from here)


def build_app(service: PolicyService) -> Any:
    """The FastAPI app of a service."""
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    app = FastAPI(title="rlops policy service", docs_url=None, redoc_url=None)
    responses_api = ResponsesAPI(service)

    def episode_of(request: Request, user: str | None) -> str | None:
        """/ep/{id}/v1/... names the episode in the URL (for a framework that builds its own client from
        a bare base_url); else the X-Episode-Id header; else the request's `user`."""
        episode = request.path_params.get("episode_id") or request.headers.get(EPISODE_HEADER) or user
        if not episode:
            service.recorder.count_unrecorded()  # served, but no episode will hold it (rollout: why_empty)
        return episode

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        refused = first.get("ctx", {}).get("error")
        if isinstance(refused, UnsupportedField):
            return JSONResponse(error_body(str(refused), code="unsupported_parameter", param=refused.field),
                                status_code=400)
        if first.get("type") == "json_invalid":
            return JSONResponse(error_body(f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}"),
                                status_code=400)
        where = ".".join(str(p) for p in first.get("loc", ())[1:])
        return JSONResponse(error_body(f"{where}: {first.get('msg', 'invalid request')}" if where else
                                       str(first.get("msg", "invalid request")), param=where or None), status_code=400)

    @app.exception_handler(ServiceError)
    async def _refused(request: Request, exc: ServiceError) -> JSONResponse:
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        return JSONResponse(error_body(str(exc), kind, exc.code), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _no_route(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405) else str(exc.detail)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return JSONResponse(error_body(message, code=code), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _failed(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"{type(exc).__name__}: {exc}", "server_error"), status_code=500)

    async def chat_completions(req: ChatRequest, request: Request) -> Any:
        if req.stream:
            return _events(service.chat_completion_stream(req, episode_of(request, req.user)))
        return await service.chat_completion(req, episode_of(request, req.user))

    async def completions(req: CompletionRequest, request: Request) -> Any:
        if req.stream:
            return _events(service.completion_stream(req, episode_of(request, req.user)))
        return await service.completion(req, episode_of(request, req.user))

    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": n, "object": "model", "created": 0, "owned_by": "rlops"}
                                           for n in service.names()]}

    async def responses(req: ResponsesRequest, request: Request) -> Any:
        if req.stream:
            return _events(responses_api.stream(req, episode_of(request, req.user)))
        return await responses_api.create(req, episode_of(request, req.user))

    for prefix in ("", "/ep/{episode_id}"):  # every endpoint also under /ep/{id}/v1
        app.post(prefix + "/v1/chat/completions")(chat_completions)
        app.post(prefix + "/v1/completions")(completions)
        app.post(prefix + "/v1/responses")(responses)
        app.get(prefix + "/v1/models")(models)

    @app.get("/rlops/episodes/{episode_id}")
    async def episode(episode_id: str) -> dict[str, Any]:
        return service.episode(episode_id)

    return app


def _events(events: Any) -> Any:
    """A Server-Sent Events response; `events` was built after the request was validated, so a refused
    request never gets here (it is an ordinary HTTP error)."""
    from fastapi.responses import StreamingResponse

    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class ServerThread:
    """uvicorn serving an app on 127.0.0.1 in a background thread; the context value is its base URL."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0) -> None:
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))  # port 0: a free one, known before the server starts
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError(f"the policy service failed to start on {self.url}")
            time.sleep(0.01)
        return self.url

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join()
        self.sock.close()
