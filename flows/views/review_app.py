"""The review server: the page and its JSON API over one run (flows/views/review.py), on uvicorn.

    GET  /                      the page (flows/views/review_page.py); `/?token=T` sets the token cookie
    GET  /api/health            {"ok": true}, without a token (what a start-up check polls)
    GET  /api/info              workspace id, run, reward columns, the judges, the default reviewer
    GET  /api/queue             ?order=step|high|low|disagreement&reward=NAME@VERSION&reviewer=NAME
    GET  /api/episodes/{id}     one episode: its HTML as `rlops inspect` shows it, messages, scores, task data, group
    GET  /api/labels            ?reviewer=NAME: that reviewer's current grades and orderings on the run
    POST /api/labels            {"kind": "grade", "workspace_id", "reviewer", "rollout_id", "value", "note"?}
                                {"kind": "order", "workspace_id", "reviewer", "order": [ids, best first], "note"?}

Refused, with `{"error": "<what is wrong>"}` and nothing written: 400 a malformed label or a value out of range,
401 no or a wrong token where one is required, 404 an episode not in the run, 409 a label for another workspace,
415 a POST that is not JSON (what a form on another site would send: browsers send a cross-site JSON request only
after asking this server, which never agrees), 421 a Host that is not this loopback server's (a DNS-rebinding page).

On loopback (the default, 127.0.0.1) no token is needed unless one is given. Bound to any other address a token is
required: `--token`, else a random one that `rlops review` prints in the page's URL.
"""

from __future__ import annotations

import ipaddress
import secrets
import sys
from typing import Any

from fastapi import Request  # at module level: FastAPI resolves handler annotations from module globals

from flows.views.review import Review, ReviewError
from flows.views.review_page import review_page

COOKIE = "rlops_review_token"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: it may resolve anywhere
        return False


def review_token(host: str, token: str | None) -> str | None:
    """The token requests must carry: the given one; none on loopback; a fresh random one on any other address."""
    if token:
        return token
    return None if is_loopback(host) else secrets.token_urlsafe(24)


def build_app(review: Review, token: str | None, hosts: set[str] | None, reviewer: str | None = None) -> Any:
    """The FastAPI app of one review. `token`: required on every request but the health check (as the cookie the
    page's URL sets, or `Authorization: Bearer`); `hosts`: the Host headers served (None: any)."""
    from fastapi import FastAPI
    from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    app = FastAPI(title="rlops review", docs_url=None, redoc_url=None, openapi_url=None)

    def refuse(status: int, message: str) -> JSONResponse:
        return JSONResponse({"error": message}, status_code=status)

    @app.middleware("http")
    async def guard(request: Request, call_next: Any) -> Any:
        if hosts is not None and request.headers.get("host") not in hosts:
            return refuse(421, f"this review server answers to {', '.join(sorted(hosts))}, not "
                               f"{request.headers.get('host')!r}")
        if token is not None and request.url.path != "/api/health":
            offered = request.query_params.get("token")
            if request.url.path == "/" and offered is not None and secrets.compare_digest(offered, token):
                response = RedirectResponse("/", status_code=303)  # the token leaves the address bar for a cookie
                response.set_cookie(COOKIE, token, httponly=True, samesite="strict")
                return response
            auth = request.headers.get("authorization", "")
            given = request.cookies.get(COOKIE) or (auth[7:] if auth.lower().startswith("bearer ") else None)
            if given is None or not secrets.compare_digest(given, token):
                return refuse(401, "this review server needs its token: open the URL `rlops review` printed "
                                   "(.../?token=...), or send the header Authorization: Bearer TOKEN")
        if request.method == "POST" and request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
            return refuse(415, "labels are sent as JSON (Content-Type: application/json)")
        return await call_next(request)

    @app.exception_handler(ReviewError)
    async def review_error(request: Request, e: ReviewError) -> JSONResponse:
        return refuse(e.status, str(e))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return refuse(e.status_code, str(e.detail))

    @app.get("/", response_class=HTMLResponse)
    def index() -> HTMLResponse:
        return HTMLResponse(review_page(review.run), headers={"Cache-Control": "no-store"})

    @app.get("/api/health")
    def health() -> dict[str, bool]:
        return {"ok": True}

    @app.get("/api/info")
    def info() -> dict[str, Any]:
        return {**review.info(), "reviewer": reviewer}

    @app.get("/api/queue")
    def queue(order: str = "step", reward: str | None = None, reviewer: str | None = None) -> list[dict[str, Any]]:
        return review.queue(order, reward, reviewer)

    @app.get("/api/episodes/{rollout_id}")
    def episode(rollout_id: str) -> dict[str, Any]:
        return review.episode(rollout_id)

    @app.get("/api/labels")
    def labels(reviewer: str) -> dict[str, Any]:
        return review.labels(reviewer)

    @app.post("/api/labels", status_code=201)
    async def submit(request: Request) -> JSONResponse:
        try:
            body = await request.json()
        except ValueError:
            raise ReviewError(400, "the body is not JSON") from None
        from starlette.concurrency import run_in_threadpool

        return JSONResponse(await run_in_threadpool(review.submit, body), status_code=201)

    return app


def serve(review: Review, host: str, port: int, token: str | None, reviewer: str | None = None) -> int:
    """Serve the review until interrupted; print where (with the token in the URL when one is required)."""
    import uvicorn

    hosts = None if token else {f"{name}:{port}" for name in ("127.0.0.1", "localhost", "[::1]", host)}
    url = f"http://{host if ':' not in host else f'[{host}]'}:{port}/" + (f"?token={token}" if token else "")
    print(f"reviewing run {review.run} ({review.info()['episodes']} episodes) at {url}", file=sys.stderr, flush=True)
    uvicorn.run(build_app(review, token, hosts, reviewer), host=host, port=port, log_level="warning")
    return 0
