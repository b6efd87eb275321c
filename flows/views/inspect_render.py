"""The inspect views (`flows/views/inspection.py`) rendered for a terminal (rich) or as a static HTML page.

Both show the same things: per reward version, a ranking table (rank, episode, step and every
reward column) and then each episode as a conversation — messages, tool calls and tool results —
with its reward rows, the judge's explanation where there is one, and the token stream split into
sampled (trained on) and masked runs. A diff shows each changed episode with both versions' rows
side by side. Model and tool text is untrusted: rich gets it as `Text` (never markup) and HTML
escapes it (flows/views/pages.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from flows.views.inspection import Change, Diff, Episode, Inspection, Score
from flows.views.pages import esc, fmt, slug, write_page
from storage.images import marked_parts

# -- terminal --------------------------------------------------------------------------------


def print_inspection(view: Inspection, console: Any = None, tokens: bool = False) -> None:
    """Print the rankings of `view` with rich (plain text when not on a terminal); `tokens` adds each
    episode's token stream with the sampled runs highlighted."""
    from rich.console import Console
    from rich.rule import Rule
    from rich.text import Text

    console = console or Console()
    where = f"step {view.step}" if view.step is not None else f"{len(view.batches)} training batch(es)"
    console.print(Rule(Text(f"run {view.run} — {view.reward}, {where}"), style="bold"))
    for ranking in view.rankings:
        console.print(Text.assemble("\n", (ranking.reward, "bold"),
                                    f": {ranking.scored} scored, {ranking.errors} errors, mean {fmt(ranking.mean)}"))
        console.print(_ranking_table(ranking.top + ranking.bottom, ranking.reward, view.columns))
        for label, episodes in (("top", ranking.top), ("bottom", ranking.bottom)):
            for i, ep in enumerate(episodes, 1):
                _print_episode(console, ep, f"{label} {i} of {ranking.reward}: {fmt(_value(ep, ranking.reward))}", tokens)


def print_diff(diff: Diff, console: Any = None, tokens: bool = False) -> None:
    """Print the episodes whose score changed most between the diff's two versions."""
    from rich.console import Console
    from rich.rule import Rule
    from rich.table import Table
    from rich.text import Text

    console = console or Console()
    console.print(Rule(Text(f"run {diff.run}: {diff.a} -> {diff.b}"), style="bold"))
    console.print(f"{diff.changed} of {diff.compared} episodes scored by both versions changed")
    for i, change in enumerate(diff.changes, 1):
        ep = change.episode
        console.print(Rule(Text(f"{i}. {ep.rollout_id} (step {ep.step}): {fmt(change.before)} -> {fmt(change.after)}"
                                f"  (delta {fmt(change.delta)})")))
        side = Table(show_header=True, expand=True)
        side.add_column(Text(diff.a))
        side.add_column(Text(diff.b))
        side.add_row(*(_score_text(ep.score(ref)) for ref in (diff.a, diff.b)))
        console.print(side)
        _print_conversation(console, ep)
        console.print(_segments_text(ep, stream=tokens))


def _value(ep: Episode, ref: str) -> float | None:
    score = ep.score(ref)
    return score.value if score else None


def _ranking_table(episodes: list[Episode], ref: str, columns: list[str]) -> Any:
    from rich.table import Table
    from rich.text import Text

    # Text, never markup strings: names and ids are data, and a "[" in them must not style the table.
    table = Table(show_header=True, header_style="bold")
    columns = [ref] + [c for c in columns if c != ref]  # the ranked version first
    for col in ["#", "episode", "step", *columns]:
        table.add_column(Text(col), overflow="fold", style="bold" if col == ref else None)
    for i, ep in enumerate(episodes, 1):
        table.add_row(*(Text(c) for c in [str(i), ep.rollout_id, str(ep.step), *(_cell(ep.score(c)) for c in columns)]))
    return table


def _cell(score: Score | None) -> str:
    if score is None:
        return ""
    if score.value is None:
        return "n/a" if score.error is None else "error"  # a null without an error: the reward does not apply
    return fmt(score.value)


def _score_text(score: Score | None) -> Any:
    from rich.text import Text

    if score is None:
        return Text("not scored")
    text = Text(f"value {_cell(score)}\n")
    if score.error:
        text.append(f"error: {score.error}\n", style="red")
    if score.explanation:
        text.append(f"judge: {score.explanation}\n", style="cyan")
    if score.details:
        text.append(json.dumps({k: v for k, v in score.details.items() if k != "explanation"}, default=str), style="dim")
    return text


def _print_episode(console: Any, ep: Episode, title: str, tokens: bool) -> None:
    from rich.rule import Rule
    from rich.table import Table
    from rich.text import Text

    r = ep.rollout
    console.print(Rule(Text(f"{title} — {ep.rollout_id}"), style="dim"))
    console.print(Text(f"step {ep.step}  prompt {r.prompt_id}  group {r.group_id}  sample {r.sample_idx}  "
                       f"finish {r.finish_reason}  turns {r.num_turns}  tool calls {r.num_tool_calls}", style="dim"))
    scores = Table(show_header=True, box=None, pad_edge=False)
    for col in ("reward", "value", "error", "details"):
        scores.add_column(col, overflow="fold")
    for s in ep.scores:
        details = {k: v for k, v in (s.details or {}).items() if k != "explanation"}
        scores.add_row(Text(s.ref), Text(_cell(s)), Text(s.error or ""), Text(json.dumps(details, default=str) if details else ""))
    console.print(scores)
    for s in ep.scores:
        if s.explanation:
            console.print(Text(f"judge ({s.ref}): {s.explanation}", style="cyan"))
    _print_env_steps(console, ep)
    _print_conversation(console, ep)
    console.print(_segments_text(ep, stream=tokens))


def _print_env_steps(console: Any, ep: Episode) -> None:
    """An environment episode step by step: what the model did, what the environment said, its reward."""
    from rich.table import Table
    from rich.text import Text

    if not ep.env_steps:
        return
    table = Table(title=f"environment steps (ended by {ep.rollout.metadata.get('env_end')})", show_header=True,
                  box=None, pad_edge=False, title_justify="left")
    for col in ("turn", "action", "reward", "done", "observation"):
        table.add_column(col, overflow="fold")
    for s in ep.env_steps:
        action = s["action"] if s["action"] is not None else f"(none: {s['error']})"
        table.add_row(str(s["turn"]), Text(action), fmt(s["reward"]), "done" if s["done"] else "", Text(s["observation"]))
    console.print(table)


_ROLE_STYLE = {"system": "dim", "user": "blue", "assistant": "green", "tool": "yellow"}


def _print_conversation(console: Any, ep: Episode) -> None:
    from rich.text import Text

    for m in ep.messages:
        head = m.role + (f" ({m.name})" if m.name else "") + (f" [result of {m.tool_call_id}]" if m.tool_call_id else "")
        text = Text(f"{head}: ", style=f"bold {_ROLE_STYLE.get(m.role, '')}")
        text.append(m.content or "")
        console.print(text)
        for call in m.tool_calls:
            console.print(Text(f"    -> tool call {call.id}: {call.name}({call.arguments})", style="yellow"))


def _segments_text(ep: Episode, stream: bool) -> Any:
    """The sampled/masked token counts and, with `stream`, the token text with sampled runs highlighted."""
    from rich.text import Text

    sampled = sum(s.tokens for s in ep.segments if s.sampled)
    text = Text(f"tokens: {sampled} sampled (trained on), {sum(s.tokens for s in ep.segments) - sampled} masked, "
                f"in {len(ep.segments)} runs" + ("" if stream else " (--tokens shows them)"), style="dim")
    if stream:
        text.append("\n")
        for seg in ep.segments:
            text.append(seg.text, style="on dark_green" if seg.sampled else "dim")
    return text


# -- HTML ----------------------------------------------------------------------------------


def inspect_page_path(out_dir: Path, reward: str, step: int | None) -> Path:
    """Where the HTML view of a reward (and step) goes; the run page links these names."""
    return out_dir / "inspect" / (f"{slug(reward)}" + (f"-step{step}" if step is not None else "") + ".html")


def diff_page_path(out_dir: Path, a: str, b: str) -> Path:
    return out_dir / "inspect" / f"diff-{slug(a)}-{slug(b.split('@', 1)[-1])}.html"


def write_inspection_html(view: Inspection, path: Path, run_page: str | None = "../run.html") -> Path:
    """Write the inspection as a static page at `path`; `run_page` is a link back (relative), if any."""
    where = f"step {view.step}" if view.step is not None else f"all {len(view.batches)} training batches"
    body = [f"<h1>Inspect {esc(view.run)}: {esc(view.reward)} ({esc(where)})</h1>", _nav(run_page),
            "<input id='filter' type='search' placeholder='filter episodes by text'>"]
    for ranking in view.rankings:
        body.append(f"<section class='ranking' data-reward='{esc(ranking.reward)}'><h2>{esc(ranking.reward)}</h2>"
                    f"<p class='meta'>{ranking.scored} episodes scored, {ranking.errors} errors, mean {fmt(ranking.mean)}; "
                    f"the {len(ranking.top)} best and the {len(ranking.bottom)} worst follow.</p>")
        body.append(_html_ranking_table(ranking.top, ranking.bottom, ranking.reward, view.columns))
        for label, episodes in (("top", ranking.top), ("bottom", ranking.bottom)):
            body.extend(_html_episode(ep, f"{label} {i}", ranking.reward) for i, ep in enumerate(episodes, 1))
        body.append("</section>")
    return write_page(path, f"inspect {view.run}: {view.reward}", "".join(body))


def write_diff_html(diff: Diff, path: Path, run_page: str | None = "../run.html") -> Path:
    """Write the version diff as a static page: each changed episode with both versions side by side."""
    body = [f"<h1>{esc(diff.run)}: {esc(diff.a)} → {esc(diff.b)}</h1>", _nav(run_page),
            f"<p class='meta'>{diff.changed} of {diff.compared} episodes scored by both versions changed; "
            f"the {len(diff.changes)} largest changes follow (errors first).</p>",
            "<input id='filter' type='search' placeholder='filter episodes by text'>",
            "<table class='diff'><tr><th>#</th><th>episode</th><th>step</th>"
            f"<th>{esc(diff.a)}</th><th>{esc(diff.b)}</th><th>change</th></tr>"]
    for i, c in enumerate(diff.changes, 1):
        body.append(f"<tr><td class='num'>{i}</td><td><a href='#ep-{esc(c.episode.rollout_id)}'>{esc(c.episode.rollout_id)}"
                    f"</a></td><td class='num'>{esc(c.episode.step)}</td><td class='num'>{fmt(c.before)}</td>"
                    f"<td class='num'>{fmt(c.after)}</td><td class='num {_direction(c)}'>{fmt(c.delta)}</td></tr>")
    body.append("</table>")
    body.extend(_html_change(c, diff, i) for i, c in enumerate(diff.changes, 1))
    return write_page(path, f"diff {diff.a} {diff.b}", "".join(body))


def _nav(run_page: str | None) -> str:
    return f"<nav><a href='{esc(run_page)}'>← run page</a></nav>" if run_page else ""


def _direction(c: Change) -> str:
    return "" if c.delta is None else ("up" if c.delta > 0 else "down")


def _html_ranking_table(top: list[Episode], bottom: list[Episode], ref: str, columns: list[str]) -> str:
    columns = [ref] + [c for c in columns if c != ref]  # the ranked version first, then every other reward
    ranked = " class='ranked'"
    head = "".join(f"<th{ranked if c == ref else ''}>{esc(c)}</th>" for c in columns)
    rows = []
    for label, episodes in (("top", top), ("bottom", bottom)):
        for i, ep in enumerate(episodes, 1):
            cells = "".join(f"<td class='num'>{esc(_cell(ep.score(c)))}</td>" for c in columns)
            rows.append(f"<tr data-rollout-id='{esc(ep.rollout_id)}'><td>{label} {i}</td><td><a href='#ep-{esc(ep.rollout_id)}'>"
                        f"{esc(ep.rollout_id)}</a></td><td class='num'>{esc(ep.step)}</td>{cells}</tr>")
    return (f"<div class='wide'><table class='rewards'><tr><th>rank</th><th>episode</th><th>step</th>{head}</tr>"
            f"{''.join(rows)}</table></div>")


def _html_scores(scores: list[Score]) -> str:
    rows = "".join(
        f"<tr class='score' data-reward='{esc(s.ref)}'><td>{esc(s.ref)}</td><td class='num'>{esc(_cell(s))}</td>"
        f"<td class='error'>{esc(s.error)}</td><td><code>{esc(_details(s))}</code></td></tr>" for s in scores)
    judged = "".join(f"<div class='explanation'><b>judge ({esc(s.ref)}):</b> {esc(s.explanation)}</div>"
                     for s in scores if s.explanation)
    return (f"<table class='scores'><tr><th>reward</th><th>value</th><th>error</th><th>details</th></tr>{rows}</table>"
            f"{judged}")


def _details(s: Score) -> str:
    details = {k: v for k, v in (s.details or {}).items() if k != "explanation"}
    return json.dumps(details, default=str) if details else ""


def _html_conversation(ep: Episode) -> str:
    out = []
    for m in ep.messages:
        head = esc(m.role) + (f" · {esc(m.name)}" if m.name else "") + (
            f" · result of {esc(m.tool_call_id)}" if m.tool_call_id else "")
        calls = "".join(f"<div class='tool-call'>→ {esc(c.name)}({esc(c.arguments)}) <span class='meta'>{esc(c.id)}</span></div>"
                        for c in m.tool_calls)
        out.append(f"<div class='msg role-{esc(m.role)}'><div class='role'>{head}</div>"
                   f"<pre>{esc(m.content) if m.role == 'assistant' else _html_content(m.content, ep.images)}</pre>{calls}</div>")
    return f"<div class='conversation'>{''.join(out)}</div>"


def _html_content(text: str | None, images: dict[str, str]) -> str:
    """A message's text, escaped, with each `<image:SHA256>` reference shown as the stored image itself."""
    out = []
    for kind, value in marked_parts(text):
        if kind == "text":
            out.append(esc(value))
        elif value in images:
            out.append(f"<img class='image' src='{esc(images[value])}' alt='image {esc(value[:12])}' "
                       f"title='image {esc(value)}' data-image-id='{esc(value)}'>")
        else:
            out.append(f"<span class='missing-image'>[image {esc(value[:12])}… is not in this workspace's image store]</span>")
    return "".join(out)


def _html_env_steps(ep: Episode) -> str:
    """The environment steps of an environment episode as a table; nothing for other episodes."""
    if not ep.env_steps:
        return ""
    rows = "".join(f"<tr><td>{s['turn']}</td><td><pre>{esc(s['action'] if s['action'] is not None else 'none: ' + str(s['error']))}"
                   f"</pre></td><td>{fmt(s['reward'])}</td><td>{'done' if s['done'] else ''}</td>"
                   f"<td><pre>{esc(s['observation'])}</pre></td></tr>" for s in ep.env_steps)
    return (f"<table class='env-steps'><caption>environment steps (ended by "
            f"{esc(ep.rollout.metadata.get('env_end'))})</caption><tr><th>turn</th><th>action</th><th>reward</th>"
            f"<th>done</th><th>observation</th></tr>{rows}</table>")


def _html_tokens(ep: Episode) -> str:
    sampled = sum(s.tokens for s in ep.segments if s.sampled)
    spans = "".join(f"<span class='{'sampled' if s.sampled else 'masked'}' title='{s.tokens} tokens'>{esc(s.text)}</span>"
                    for s in ep.segments)
    return (f"<details class='tokens'><summary>tokens: {sampled} sampled (highlighted, trained on), "
            f"{sum(s.tokens for s in ep.segments) - sampled} masked</summary><pre>{spans}</pre></details>")


def _html_meta(ep: Episode) -> str:
    r = ep.rollout
    return (f"<div class='meta'>step {esc(ep.step)} · prompt {esc(r.prompt_id)} · group {esc(r.group_id)} · sample "
            f"{r.sample_idx} · finish {esc(r.finish_reason)}{' (truncated)' if r.truncated else ''} · turns {r.num_turns} · "
            f"tool calls {r.num_tool_calls} · policy {esc(r.policy_id)}</div>")


def episode_body(ep: Episode) -> str:
    """An episode as every page shows it, escaped: its meta line, reward rows and judge explanations, environment
    steps, conversation (tool calls, tool results, images) and token runs (the review page inserts this)."""
    return f"{_html_meta(ep)}{_html_scores(ep.scores)}{_html_env_steps(ep)}{_html_conversation(ep)}{_html_tokens(ep)}"


def _html_episode(ep: Episode, label: str, ref: str) -> str:
    value = _value(ep, ref)
    return (f"<article class='episode' id='ep-{esc(ep.rollout_id)}' data-rollout-id='{esc(ep.rollout_id)}' "
            f"data-rank='{esc(label)}' data-value='{esc(value)}'><h3>{esc(label)} · {esc(ref)} = {fmt(value)} · "
            f"{esc(ep.rollout_id)}</h3>{episode_body(ep)}</article>")


def _html_change(c: Change, diff: Diff, i: int) -> str:
    ep = c.episode
    sides = "".join(f"<div><h3>{esc(ref)}: {fmt(v)}</h3>{_html_scores([s] if (s := ep.score(ref)) else [])}</div>"
                    for ref, v in ((diff.a, c.before), (diff.b, c.after)))
    return (f"<article class='episode change' id='ep-{esc(ep.rollout_id)}' data-rollout-id='{esc(ep.rollout_id)}' "
            f"data-before='{esc(c.before)}' data-after='{esc(c.after)}'><h3>{i}. {esc(ep.rollout_id)}: "
            f"{fmt(c.before)} → {fmt(c.after)}</h3>{_html_meta(ep)}<div class='side'>{sides}</div>"
            f"<details><summary>every reward on this episode</summary>{_html_scores(ep.scores)}</details>"
            f"{_html_env_steps(ep)}{_html_conversation(ep)}{_html_tokens(ep)}</article>")
