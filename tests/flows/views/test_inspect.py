"""Looking at what the agent did: `rlops inspect` (terminal and HTML) and version diffs, on the views'
shared run (tests/flows/views/conftest.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from storage.workspace import Workspace
from tests.flows.conftest import rlops_here
from tests.flows.views.conftest import MARKUP, RUN, XSS, cli, soup

# The shared run takes minutes on 2 cores: one xdist worker sets it up for all three modules (--dist loadgroup).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("views_run")]


def _scores(ws: Workspace, run: str, name: str) -> dict[str, dict[str, float | None]]:
    """version -> rollout id -> value over the run's training batches, computed here independently."""
    rows = ws.query(
        "SELECT w.reward_version, w.rollout_id, w.value FROM rewards w JOIN stage_runs s ON s.artifact_id = w.batch_id "
        f"JOIN artifacts a ON a.artifact_id = w.batch_id WHERE s.stage = 'rollout' AND s.run_name = '{run}' "
        f"AND a.meta->>'split' = 'train' AND w.reward_name = '{name}'").to_pylist()
    out: dict[str, dict[str, float | None]] = {}
    for r in rows:
        out.setdefault(r["reward_version"], {})[r["rollout_id"]] = r["value"]
    return out


def _expected_ends(values: dict[str, float | None], top: int) -> tuple[list[str], list[str]]:
    scored = [(v, r) for r, v in values.items() if v is not None]
    best = [r for _, r in sorted(scored, key=lambda p: (-p[0], p[1]))[:top]]
    worst = [r for _, r in sorted(scored, key=lambda p: (p[0], [-ord(c) for c in p[1]]))][: min(top, len(scored) - len(best))]
    return best, worst


# -- inspect -------------------------------------------------------------------------------


def test_html_shows_the_best_and_worst_episodes_per_version_in_order(run_ws: Workspace) -> None:
    from flows.views.inspect_render import write_inspection_html
    from flows.views.inspection import inspect_run

    view = inspect_run(run_ws, RUN, "short", top=2)
    page = soup(write_inspection_html(view, run_ws.root / "t" / "short.html"))
    expected = _scores(run_ws, RUN, "short")
    assert len(expected) == 2  # the run's version and the retrain's edited one
    sections = page.select("section.ranking")
    assert [s["data-reward"] for s in sections] == [r.reward for r in view.rankings]
    assert {s["data-reward"] for s in sections} == {f"short@{v}" for v in expected}
    for section in sections:
        values = expected[section["data-reward"].split("@")[1]]
        best, worst = _expected_ends(values, 2)
        episodes = section.select("article.episode")
        assert [e["data-rollout-id"] for e in episodes] == best + worst
        assert [e["data-rank"] for e in episodes] == ["top 1", "top 2", "bottom 1", "bottom 2"][: len(best) + len(worst)]
        shown = [float(e["data-value"]) for e in episodes]
        assert shown == [values[r] for r in best + worst]
        assert shown[: len(best)] == sorted(shown[: len(best)], reverse=True)
        assert shown[len(best):] == sorted(shown[len(best):])
        # the ranking table lists the same episodes in the same order
        assert [tr["data-rollout-id"] for tr in section.select("table.rewards tr[data-rollout-id]")] == best + worst


def test_every_reward_column_and_row_is_shown(run_ws: Workspace) -> None:
    from flows.views.inspect_render import write_inspection_html
    from flows.views.inspection import inspect_run

    page = soup(write_inspection_html(inspect_run(run_ws, RUN, top=1), run_ws.root / "t" / "total.html"))
    refs = {f"{name}@{v}" for name in ("correct", "short", "total", "judged") for v in _scores(run_ws, RUN, name)}
    assert len(refs) == 6  # correct, judged: one version each; short and total: two each
    first = page.select("section.ranking")[0]
    header = [th.get_text() for th in first.select("table.rewards tr")[0].find_all("th")]
    assert header[:4] == ["rank", "episode", "step", first["data-reward"]] and set(header[3:]) == refs
    for article in page.select("article.episode"):
        rid = article["data-rollout-id"]
        stored = run_ws.query(f"SELECT reward_name || '@' || reward_version AS ref, value FROM rewards "
                              f"WHERE rollout_id = '{rid}'").to_pylist()
        shown = {tr["data-reward"]: tr.find_all("td")[1].get_text() for tr in article.select("tr.score")}
        assert set(shown) == {r["ref"] for r in stored}
        assert all(float(shown[r["ref"]]) == pytest.approx(r["value"], rel=1e-3) for r in stored)
        assert article.select_one(".explanation").get_text().startswith("judge (judged@")  # the judge-like reward
        # sampled/masked split: the highlighted runs are exactly the loss-mask-1 tokens
        mask = run_ws.query(f"SELECT loss_mask FROM rollouts WHERE rollout_id = '{rid}'").to_pylist()[0]["loss_mask"]
        spans = article.select("details.tokens span")
        assert sum(int(s["title"].split()[0]) for s in spans if "sampled" in s["class"]) == sum(mask)
        assert sum(int(s["title"].split()[0]) for s in spans) == len(mask)
        roles = [d.select_one(".role").get_text() for d in article.select(".msg")]
        assert roles[:2] == ["system", "user"] and roles[-1] == "assistant"


def test_model_text_is_escaped(run_ws: Workspace) -> None:
    from flows.views.inspect_render import write_inspection_html
    from flows.views.inspection import inspect_run

    path = write_inspection_html(inspect_run(run_ws, "tools", "judged", top=3), run_ws.root / "t" / "tools.html")
    raw = path.read_text()
    page = soup(path)
    assert XSS not in raw and "&lt;script&gt;alert(1)&lt;/script&gt;" in raw
    scripts = page.find_all("script")
    assert len(scripts) == 1 and "alert" not in scripts[0].get_text()  # only the page's own script
    assert not page.select("article b") or all(b.get_text().startswith("judge (") for b in page.select("article b"))
    text = page.get_text()
    assert XSS in text and MARKUP in text and "the answer <b>" in text  # shown as text, verbatim
    # tool calls and tool results are part of the conversation
    first = page.select_one("article.episode")
    calls = [c.get_text() for c in first.select(".tool-call")]
    assert calls[0].startswith('→ search({"query": "Vexhollow founded"})') and calls[1].startswith("→ read(")
    tool_msgs = first.select(".msg.role-tool")
    assert "result of call_0_0" in tool_msgs[0].select_one(".role").get_text()
    assert XSS in tool_msgs[0].select_one("pre").get_text()


def test_terminal_view_through_the_cli(run_ws: Workspace, capsys: pytest.CaptureFixture[str]) -> None:
    ws = ("--workspace", str(run_ws.root))
    text = rlops_here(capsys, "inspect", "tools", "--reward", "correct", "--top", "1", "--tokens", *ws)
    best, worst = _expected_ends(next(iter(_scores(run_ws, "tools", "correct").values())), 1)
    assert text.index(best[0]) < text.index(worst[0])
    assert "top 1 of correct@" in text and "bottom 1 of correct@" in text
    assert "tool call call_0_0: search(" in text and "judge (judged@" in text and "tokens:" in text
    assert MARKUP in text and XSS in text  # rich printed them as text, not as markup

    out = rlops_here(capsys, "inspect", RUN, "--step", "1", "--format", "html", "--top", "1", *ws)
    page = Path(out.strip().splitlines()[-1])
    assert page == run_ws.root / "reports" / RUN / "inspect" / "total-step1.html"
    batch = set(next(c for c in run_ws.catalog.checkpoints(RUN) if c["step"] == 1)["trained_on"]["batches"])
    shown = [a["data-rollout-id"] for a in soup(page).select("article.episode")]
    assert shown
    assert {run_ws.query(f"SELECT batch_id FROM rollouts WHERE rollout_id = '{r}'").to_pylist()[0]["batch_id"]
            for r in shown} == batch


@pytest.mark.parametrize("args, message", [
    (["nope"], "run 'nope' has no training rollout batches"),
    (["insp", "--reward", "missing"], "no 'missing' rewards on run 'insp'"),
    (["insp", "--reward", "short@0000"], "short@0000 was not scored"),
    (["insp", "--step", "9"], "no training batch at update step 9 (steps: [1, 2])"),
    (["insp", "--diff", "short", "short@x"], "--diff takes two NAME@VERSION"),
    (["insp", "--top", "0"], "--top must be at least 1"),
])
def test_bad_input_is_a_clear_error(run_ws: Workspace, args: list[str], message: str) -> None:
    out = cli(run_ws.root, "inspect", *args)
    assert out.returncode == 1 and message in out.stderr, out.stderr
    assert not out.stdout


# -- version diffs ---------------------------------------------------------------------------


def test_diff_shows_the_largest_changes_side_by_side(run_ws: Workspace, capsys: pytest.CaptureFixture[str]) -> None:
    versions = list(_scores(run_ws, RUN, "short").items())
    (va, before), (vb, after) = sorted(versions, key=lambda kv: run_ws.query(
        f"SELECT min(scored_at) AS t FROM rewards WHERE reward_version = '{kv[0]}'").to_pylist()[0]["t"])
    a, b = f"short@{va}", f"short@{vb}"
    changed = {r: after[r] - before[r] for r in before if before[r] != after[r]}
    assert changed  # limit 8 -> 2 changes the length penalty of non-empty answers

    ws = ("--workspace", str(run_ws.root))
    page = soup(Path(rlops_here(capsys, "inspect", RUN, "--diff", a, b, "--top", "3", "--format", "html", *ws
                                ).strip().splitlines()[-1]))
    assert f"{len(changed)} of {len(before)} episodes" in page.get_text()
    articles = page.select("article.change")
    expected = sorted(changed, key=lambda r: (-abs(changed[r]), r))[:3]
    assert [x["data-rollout-id"] for x in articles] == expected
    for x in articles:
        rid = x["data-rollout-id"]
        assert float(x["data-before"]) == before[rid] and float(x["data-after"]) == after[rid]
        left, right = x.select(".side > div")
        assert left.select_one("tr.score")["data-reward"] == a and right.select_one("tr.score")["data-reward"] == b

    text = rlops_here(capsys, "inspect", RUN, "--diff", a, b, "--top", "1", *ws)
    assert expected[0] in text and f"{len(changed)} of {len(before)}" in text
