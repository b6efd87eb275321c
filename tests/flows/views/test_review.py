"""`rlops review`: a person grades and orders episodes in real headless Chromium, the labels land in the `labels`
view and come back after a reload; bad requests are refused by name with nothing written; a token guards a server
that needs one. On the views' shared run (tests/flows/views/conftest.py), its hand-built "tools" episodes."""

from __future__ import annotations

import httpx
import pytest

from flows.views.review_app import is_loopback, review_token
from storage.workspace import Workspace
from tests.browser import Browser, Page
from tests.flows.views.conftest import XSS, needs_chromium

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("views_run")]  # with the other readers of the shared run


def current(page: Page) -> str:
    return page.eval("document.getElementById('episode').dataset.rolloutId")


def saves(page: Page, n: int) -> None:
    """Wait until the page has saved `n` labels (and shown the next episode after a grade)."""
    page.wait_for(f"document.body.dataset.saves === '{n}' || document.documentElement.dataset.error")
    assert page.eval("document.documentElement.dataset.error || ''") == ""


def order_shown(page: Page) -> list[str]:
    return page.eval("Array.from(document.querySelectorAll('#order-list li')).map(function(l){return l.dataset.rolloutId})")


def labels(ws: Workspace, reviewer: str) -> list[dict]:
    return ws.query("SELECT kind, rollout_id, value, rank, note, current FROM labels WHERE reviewer = ? "
                    "ORDER BY created_at, rank", [reviewer]).to_pylist()


@needs_chromium
def test_a_reviewer_grades_ten_episodes_and_orders_a_group_in_the_browser(run_ws: Workspace, review_url: str,
                                                                         tmp_path) -> None:
    with Browser(tmp_path) as browser:
        page = browser.open(review_url + "/")
        page.wait_for("document.documentElement.dataset.ready === '1'", timeout=120)
        assert page.eval("document.getElementById('reviewer').value") == "alice"  # the server's --reviewer
        queue = page.eval("Array.from(document.querySelectorAll('#queue li')).map(function(l){return l.dataset.rolloutId})")
        assert len(queue) == 12 and current(page) == queue[0]  # by step: group by group, sample by sample
        # Model and tool text is shown as text: no script of the episode's in the page, its text visible.
        assert page.eval("document.querySelectorAll('#episode-body script').length") == 0
        assert XSS in page.eval("document.getElementById('episode-body').textContent")

        expected: dict[str, tuple[float, str | None]] = {}

        def by(action, value: float, note: str | None = None) -> None:
            shown = current(page)
            action()
            saves(page, len(expected) + 1)
            expected[shown] = (value, note)

        for key, value in [("g", 1.0), ("b", 0.0), ("3", 0.5), ("5", 1.0), ("g", 1.0)]:  # keys
            by(lambda: page.key(key), value)
        by(lambda: page.click("#good"), 1.0)  # clicks
        by(lambda: page.click("#bad"), 0.0)

        def typed_score() -> None:
            page.click("#score")
            page.type("0.8")
            page.key("Enter")

        by(typed_score, 0.8)

        def with_note() -> None:
            page.key("n")  # to the note field, typed, left with Esc, sent with the next grade
            page.type("the right year, found with two tool calls")
            page.key("Escape")
            page.key("g")

        by(with_note, 1.0, "the right year, found with two tool calls")
        page.key("j")  # skip one
        page.wait_for(f"document.getElementById('episode').dataset.rolloutId === '{queue[10]}'")
        by(lambda: page.key("b"), 0.0)
        assert list(expected) == queue[:9] + [queue[10]]

        # Order the group of the episode now shown (the last: group g3), by keys and a drag.
        assert current(page) == queue[11]
        page.key("o")
        page.wait_for("!document.getElementById('group-panel').hidden")
        g3 = order_shown(page)
        assert g3 == queue[9:12]  # sample order; the current episode (the last) chosen
        page.key("ArrowUp")  # choose the middle row
        page.key("ArrowUp", shift=True)  # move it to the top: s1, s0, s2
        page.drag("#order-list li:nth-child(3)", "#order-list li:nth-child(1)")  # s2 dragged to the top
        assert order_shown(page) == [g3[2], g3[1], g3[0]]
        page.key("Enter")
        saves(page, len(expected) + 1)

        rows = labels(run_ws, "alice")
        grades = {r["rollout_id"]: (r["value"], r["note"]) for r in rows if r["kind"] == "grade"}
        assert grades == expected and all(r["current"] for r in rows)
        assert [(r["rollout_id"], r["rank"]) for r in rows if r["kind"] == "order"] == [(g3[2], 1), (g3[1], 2), (g3[0], 3)]

        # A reload shows them: the queue marks the ten grades and the ordered group, an episode shows its label,
        # and the group's panel opens in the saved order.
        page.reload()
        page.wait_for("document.documentElement.dataset.ready === '1'", timeout=60)
        marked = page.eval("Object.fromEntries(Array.from(document.querySelectorAll('#queue li.graded'))"
                           ".map(function(l){return [l.dataset.rolloutId, parseFloat(l.dataset.mine)]}))")
        assert marked == {r: v for r, (v, _) in expected.items()}
        assert page.eval("Array.from(document.querySelectorAll('#queue li.ordered')).map(function(l){"
                         "return l.dataset.rolloutId})") == queue[9:12]
        assert current(page) == queue[0]  # each episode has a label of alice's now: the page starts at the top
        assert "your grade: 1" in page.eval("document.getElementById('mine').textContent")
        page.click(f"#queue li[data-rollout-id='{queue[9]}']")
        page.wait_for(f"document.getElementById('episode').dataset.rolloutId === '{queue[9]}'")
        assert page.eval("document.getElementById('mine').textContent") == "your grade: none · group ordered: #3 of 3"
        page.key("o")
        page.wait_for("!document.getElementById('group-panel').hidden")
        assert order_shown(page) == [g3[2], g3[1], g3[0]]
        assert page.eval("document.documentElement.dataset.jsError || ''") == ""


def _post(url: str, body: object, **kw) -> httpx.Response:
    return httpx.post(url + "/api/labels", json=body, timeout=60, **kw)


def test_bad_labels_are_refused_by_name_and_nothing_is_written(run_ws: Workspace, review_url: str) -> None:
    wid = run_ws.workspace_id
    before = run_ws.query("SELECT count(*) AS n FROM labels").to_pylist()[0]["n"]
    grade = {"kind": "grade", "workspace_id": wid, "reviewer": "mallory", "rollout_id": "ro-tools-g0-s0", "value": 1.0}
    cases = [
        ({**grade, "rollout_id": "ro-nope"}, 404, "unknown rollout id 'ro-nope': not an episode of run 'tools'"),
        ({**grade, "value": 1.5}, 400, "value: a grade is a number in [0, 1]"),
        ({**grade, "value": "high"}, 400, "value: Input should be a valid number"),
        ({**grade, "workspace_id": "ws-elsewhere"}, 409, "label for workspace 'ws-elsewhere'"),
        ({**grade, "reviewer": ""}, 400, "reviewer: a name of 1 to 64"),
        ({**grade, "extra": 1}, 400, "extra: Extra inputs are not permitted"),
        ({"kind": "order", "workspace_id": wid, "reviewer": "mallory", "order": ["ro-tools-g0-s0", "ro-tools-g1-s0"]},
         400, "every episode must be of one group"),
        ({"kind": "vote"}, 400, "a label is a JSON object with kind 'grade'"),
    ]
    for body, status, message in cases:
        answer = _post(review_url, body)
        assert answer.status_code == status and message in answer.json()["error"], (body, answer.text)
    for query, message in [("order=high&reward=nope@1", "reward: a NAME@VERSION scored on run 'tools'"),
                           ("order=random", "order: one of step, high, low, disagreement")]:
        answer = httpx.get(f"{review_url}/api/queue?{query}", timeout=60)
        assert answer.status_code == 400 and message in answer.json()["error"], answer.text
    form = httpx.post(review_url + "/api/labels", data={"kind": "grade"}, timeout=60)  # what a cross-site form sends
    assert form.status_code == 415
    rebound = httpx.get(review_url + "/api/info", headers={"Host": "attacker.example"}, timeout=60)  # DNS rebinding
    assert rebound.status_code == 421
    assert run_ws.query("SELECT count(*) AS n FROM labels").to_pylist()[0]["n"] == before


def test_a_server_with_a_token_refuses_requests_without_it(run_ws: Workspace) -> None:
    """The app `rlops review --token` serves, on uvicorn on 127.0.0.1 (in this process: no second start-up)."""
    from flows.views.review import Review
    from flows.views.review_app import build_app
    from stages.service.app import ServerThread

    assert review_token("127.0.0.1", None) is None and review_token("0.0.0.0", None)  # beyond loopback: always one
    assert is_loopback("localhost") and is_loopback("::1") and not is_loopback("0.0.0.0")
    with ServerThread(build_app(Review(run_ws, "tools"), "s3cret", None)) as url:
        body = {"kind": "grade", "workspace_id": run_ws.workspace_id, "reviewer": "tok", "rollout_id": "ro-tools-g0-s0",
                "value": 1.0}
        assert httpx.get(url + "/api/info", timeout=60).status_code == 401
        refused = _post(url, body)
        assert refused.status_code == 401 and "needs its token" in refused.json()["error"]
        assert _post(url, body, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert run_ws.query("SELECT count(*) AS n FROM labels WHERE reviewer = 'tok'").to_pylist()[0]["n"] == 0
        with httpx.Client(base_url=url, timeout=60, follow_redirects=True) as browser_like:  # the printed URL
            first = browser_like.get("/?token=s3cret")  # token -> cookie -> the page, then the API
            assert first.status_code == 200 and "Review tools" in first.text and first.history[0].status_code == 303
            assert browser_like.post("/api/labels", json=body).status_code == 201
        assert _post(url, body, headers={"Authorization": "Bearer s3cret"}).status_code == 201
    assert run_ws.query("SELECT count(*) AS n FROM labels WHERE reviewer = 'tok'").to_pylist()[0]["n"] == 2


def test_an_unknown_run_is_named(run_ws: Workspace) -> None:
    from flows.views.agreement import agreement
    from flows.views.review import Review

    for start in (lambda: Review(run_ws, "nope"), lambda: agreement(run_ws, "nope")):
        with pytest.raises(KeyError, match="run 'nope' has no rollout batches"):
            start()
