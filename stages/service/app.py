"""The policy service over HTTP: the OpenAI-compatible FastAPI app and the uvicorn thread serving it.

    resolve, names = catalog_resolver(checkpoints_file, base)
    service = PolicyService(ResidentPolicy.load(base), resolve, names=names)
    with ServerThread(build_app(service)) as url:      # uvicorn on 127.0.0.1, a free port
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")

Endpoints: `POST /v1/chat/completions` (messages, tools, n, temperature, top_p, max_tokens, stop,
seed, logprobs, stream), `POST /v1/completions`, `POST /v1/responses` (stages/service/responses.py),
Anthropic's `POST /v1/messages` and `/v1/messages/count_tokens` (stages/service/messages.py),
`GET /v1/models`, each also under `/ep/{episode_id}/v1/...`, `GET /rlops/episodes/{id}` (an
episode's recorded tokens, assembled as a rollout) and, with a traffic log (`rlops serve`),
`POST /rlops/episodes/{id}/feedback` (a score, label, comment and who, as LangSmith and Langfuse take
feedback; storage/traffic.py). A call is recorded under the episode id of its URL, else of its
`X-Episode-Id` header, else of its `user` field; who sent it (session, user, tags) is its `Caller`
(stages/service/served.py).

Errors are OpenAI-style JSON: 400 for a malformed request, a refused field (named in `param`, see
stages/service/schemas.py), a prompt over the context or a refused image (stages/service/service.py), 404 for an unknown model, episode, stored
response or route, 500 (with the message, never a traceback) if generation fails; the server keeps
serving. On the Messages routes errors are Anthropic's shape instead
(`{"type": "error", "error": {"type": "invalid_request_error" | "not_found_error" | "api_error", ...}}`).
A streamed request fails before its stream starts as such an error, during it with an
error event.
"""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import time
from typing import Any

from fastapi import Request  # at module level: FastAPI resolves handler annotations from module globals
from pydantic import AliasChoices, BaseModel, ConfigDict, Field

from stages.service.completions import completion, completion_stream
from stages.service.messages import CountTokensRequest, MessagesAPI, MessagesRequest, anthropic_error
from stages.service.responses import ResponsesAPI
from stages.service.schemas import ChatRequest, CompletionRequest, ResponsesRequest, UnsupportedField, error_body
from stages.service.served import Caller, caller
from stages.service.service import PolicyService, ServiceError
from storage.traffic import FeedbackError, TrafficLog
from tasks.agent import EPISODE_HEADER  # its one home is the agent contract (external.py imports it from here)

_ANTHROPIC_ROUTE = re.compile(r"(/ep/[^/]+)?/v1/messages(/|$)")  # Anthropic's Messages API: its error shape


def build_app(service: PolicyService, traffic: TrafficLog | None = None) -> Any:
    """The FastAPI app of a service; with `traffic` (`rlops serve`) it also takes feedback on recorded episodes."""
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    app = FastAPI(title="rlops policy service", docs_url=None, redoc_url=None)
    responses_api = ResponsesAPI(service)
    messages_api = MessagesAPI(service)

    def caller_of(request: Request, api: str, stream: bool, user: str | None,
                  metadata: dict[str, Any] | None = None) -> Caller:
        return caller(episode=episode_of(request, user), api=api, stream=stream, user_field=user, metadata=metadata,
                      headers=request.headers)

    def episode_of(request: Request, user: str | None) -> str | None:
        """/ep/{id}/v1/... names the episode in the URL (for a framework that builds its own client from
        a bare base_url); else the X-Episode-Id header; else the request's `user`."""
        episode = request.path_params.get("episode_id") or request.headers.get(EPISODE_HEADER) or user
        if not episode:
            service.recorder.count_unrecorded()  # served, but no episode will hold it (rollout: why_empty)
        return episode

    def error(request: Request, status: int, message: str, code: str | None = None,
              param: str | None = None) -> JSONResponse:
        """An error in the shape of the route's API: Anthropic's on /v1/messages..., else OpenAI's."""
        if _ANTHROPIC_ROUTE.match(request.url.path):
            return JSONResponse(anthropic_error(status, message), status_code=status)
        kind = "invalid_request_error" if status < 500 else "server_error"
        return JSONResponse(error_body(message, kind, code, param), status_code=status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        refused = first.get("ctx", {}).get("error")
        if isinstance(refused, UnsupportedField):
            return error(request, 400, str(refused), code="unsupported_parameter", param=refused.field)
        if first.get("type") == "json_invalid":
            return error(request, 400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}")
        where = ".".join(str(p) for p in first.get("loc", ())[1:])
        return error(request, 400, f"{where}: {first.get('msg', 'invalid request')}" if where else
                     str(first.get("msg", "invalid request")), param=where or None)

    @app.exception_handler(ServiceError)
    async def _refused(request: Request, exc: ServiceError) -> JSONResponse:
        return error(request, exc.status, str(exc), exc.code, exc.param)

    @app.exception_handler(StarletteHTTPException)
    async def _no_route(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405) else str(exc.detail)
        return error(request, exc.status_code, message, {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code))

    @app.exception_handler(Exception)
    async def _failed(request: Request, exc: Exception) -> JSONResponse:
        return error(request, 500, f"{type(exc).__name__}: {exc}")

    async def chat_completions(req: ChatRequest, request: Request) -> Any:
        who = caller_of(request, "chat", req.stream, req.user, req.metadata)
        if req.stream:
            return _events(service.chat_completion_stream(req, who))
        return await service.chat_completion(req, who)

    async def completions(req: CompletionRequest, request: Request) -> Any:
        if req.stream:
            return _events(completion_stream(service, req, episode_of(request, req.user)))
        return await completion(service, req, episode_of(request, req.user))

    async def models() -> dict[str, Any]:
        # An entry may say more than its name: an alias's version and policy (stages/service/resolve.py).
        return {"object": "list", "data": [{**({"id": n} if isinstance(n, str) else n), "object": "model", "created": 0,
                                            "owned_by": "rlops"} for n in service.names()]}

    async def responses(req: ResponsesRequest, request: Request) -> Any:
        who = caller_of(request, "responses", req.stream, req.user, req.metadata)
        if req.stream:
            return _events(responses_api.stream(req, who))
        return await responses_api.create(req, who)

    async def messages(req: MessagesRequest, request: Request) -> Any:
        user = req.metadata.user_id if req.metadata else None
        who = caller_of(request, "messages", req.stream, user)
        if req.stream:
            return _events(messages_api.stream(req, who))
        return await messages_api.create(req, who)

    async def count_tokens(req: CountTokensRequest, request: Request) -> dict[str, Any]:
        return messages_api.count_tokens(req, request.path_params.get("episode_id") or request.headers.get(EPISODE_HEADER))

    for prefix in ("", "/ep/{episode_id}"):  # every endpoint also under /ep/{id}/v1
        app.post(prefix + "/v1/messages")(messages)
        app.post(prefix + "/v1/messages/count_tokens")(count_tokens)
        app.post(prefix + "/v1/chat/completions")(chat_completions)
        app.post(prefix + "/v1/completions")(completions)
        app.post(prefix + "/v1/responses")(responses)
        app.get(prefix + "/v1/models")(models)

    @app.get("/rlops/episodes/{episode_id}")
    async def episode(episode_id: str) -> dict[str, Any]:
        return service.episode(episode_id)

    @app.post("/rlops/episodes/{episode_id}/feedback")
    async def feedback(episode_id: str, body: Feedback) -> dict[str, Any]:
        if traffic is None:
            raise ServiceError(404, "this server keeps no traffic (rlops serve --record off): no feedback is stored",
                               "not_found")
        try:
            fid = await asyncio.to_thread(traffic.feedback, episode_id, **body.model_dump())
        except FeedbackError as e:
            raise ServiceError(400, str(e), "invalid_feedback", str(e).split(":")[0]) from None
        except KeyError as e:
            raise ServiceError(404, e.args[0], "episode_not_found") from None
        return {"id": fid, "object": "feedback", "episode_id": episode_id}

    return app


class Feedback(BaseModel):
    """A feedback body: LangSmith's (`key`, `score`, `comment`) and Langfuse's (`name`, `value`, `comment`) fields,
    with `label` for a categorical value and `who` for its author; `call_id` names one call of the episode."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    score: float | None = Field(None, validation_alias=AliasChoices("score", "value"))
    label: str | None = None
    comment: str | None = None
    who: str | None = Field(None, validation_alias=AliasChoices("who", "source", "user_id"))
    key: str | None = Field(None, validation_alias=AliasChoices("key", "name"))
    call_id: str | None = None


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
