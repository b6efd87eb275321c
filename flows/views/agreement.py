"""How far each reward agrees with people's labels on a run, with intervals: `rlops review agreement RUN` and the
run page's section.

    report = agreement(ws, "arithmetic-demo")              # every reviewer; reviewer="alice" for one
    print_agreement(report)  /  agreement_html(report)

GRPO and DPO use a reward's order within a group, so that is what is measured, per reward name@version, over the
labelled groups of the run's episodes (`flows.views.inspection.episode_batches`):

- **pairwise accuracy**: of the pairs of one group a reviewer tells apart (an ordering: every pair; grades: two
  different grades), the share the reward orders the same way, a tie counting half (chance is 0.5);
- **Kendall's tau** (tau-b) between each ordered group and the reward, averaged over the orderings.

The per-group counts are SQL (`label_agreement_groups`, storage/labels.py), so `rlops sql` gives the same numbers
(`label_agreement`: the whole workspace). The 95 % intervals are a percentile bootstrap over groups (pairs of one
group are not independent: a reward that misreads one trait of the prompt's answers gets all its pairs wrong).
Between reviewers, reviewer B's labels are judged against reviewer A's pairs in the same way.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from flows.views.inspection import episode_batches, read_views
from flows.views.pages import esc, fmt
from flows.registry import print_rows
from storage.workspace import Workspace

RESAMPLES = 2000  # bootstrap resamples: the interval's ends move by < 0.01 between seeds at this many
LEVEL = 0.95


@dataclass(frozen=True)
class Agreement:
    """One judge (a reward name@version, or a reviewer) against the labels."""

    judge: str  # "correct@228c7d9b6e3e", or "bob vs alice" (bob's labels judged on alice's pairs)
    groups: int  # groups with a pair the judge could score
    pairs: int
    concordant: int
    discordant: int
    ties: int  # pairs the judge gives equal values
    accuracy: float  # (concordant + ties / 2) / pairs
    accuracy_low: float
    accuracy_high: float
    ranked_groups: int  # orderings with a defined tau (the judge does not tie the whole group)
    mean_tau: float | None
    tau_low: float | None
    tau_high: float | None


@dataclass(frozen=True)
class Overlap:
    """Two reviewers on the episodes both labelled, pairs or not (a held-out episode is a group of one)."""

    reviewers: str  # "alice and bob"
    episodes: int
    same_verdict: float  # both good (value >= 0.5) or both bad
    low: float  # its 95 % bootstrap interval over the episodes
    high: float
    mean_abs_difference: float


@dataclass
class AgreementReport:
    run: str
    reviewers: list[str]  # whose labels were counted
    labelled: int  # episodes of the run with a current label of theirs
    rewards: list[Agreement] = field(default_factory=list)  # by reward name, then version
    between_reviewers: list[Agreement] = field(default_factory=list)
    same_episodes: list[Overlap] = field(default_factory=list)


def measure(judge: str, rows: list[dict[str, Any]], resamples: int = RESAMPLES, seed: int = 0) -> Agreement:
    """Pool per-group rows (`pairs`, `concordant`, `discordant`, `ties`, `kendall_tau`, keyed by `batch_id` and
    `group_id`; several reviewers' rows of a group are one group) into one Agreement, with bootstrap intervals:
    resample the groups with replacement, recompute both statistics, take the central 95 %."""
    import numpy as np

    keys = sorted({(r["batch_id"], r["group_id"]) for r in rows})
    index = {k: i for i, k in enumerate(keys)}
    pairs, score, tau_sum, tau_n = (np.zeros(len(keys)) for _ in range(4))  # (G,) per group
    counts = {"concordant": 0, "discordant": 0, "ties": 0}
    for r in rows:
        g = index[(r["batch_id"], r["group_id"])]
        pairs[g] += r["pairs"]
        score[g] += r["concordant"] + r["ties"] / 2
        for k in counts:
            counts[k] += r[k]
        if r["kendall_tau"] is not None:
            tau_sum[g] += r["kendall_tau"]
            tau_n[g] += 1
    # (B, G): how often each resample draws each group
    draws = np.random.default_rng(seed).multinomial(len(keys), np.full(len(keys), 1 / len(keys)), size=resamples)
    accuracy = draws @ score / (draws @ pairs)  # every group has a pair, so no resample divides by 0
    with np.errstate(invalid="ignore", divide="ignore"):
        taus = draws @ tau_sum / (draws @ tau_n)  # nan where a resample drew no ordering
    tail = 100 * (1 - LEVEL) / 2
    low, high = np.percentile(accuracy, [tail, 100 - tail])
    ranked = int(tau_n.sum())
    if ranked:
        tau_low, tau_high = (float(x) for x in np.nanpercentile(taus, [tail, 100 - tail]))
    return Agreement(judge, len(keys), int(pairs.sum()), counts["concordant"], counts["discordant"], counts["ties"],
                     float(score.sum() / pairs.sum()), float(low), float(high), ranked,
                     float(tau_sum.sum() / ranked) if ranked else None,
                     tau_low if ranked else None, tau_high if ranked else None)


def overlap(reviewers: str, values: list[tuple[float, float]], resamples: int = RESAMPLES, seed: int = 0) -> Overlap:
    """Two reviewers' (value_a, value_b) on the same episodes: the share with the same verdict, with a bootstrap
    interval over the episodes, and the mean absolute difference."""
    import numpy as np

    a, b = np.array(values).T  # (E,) each
    same = ((a >= 0.5) == (b >= 0.5)).astype(float)
    draws = np.random.default_rng(seed).multinomial(len(same), np.full(len(same), 1 / len(same)), size=resamples)
    low, high = np.percentile(draws @ same / len(same), [100 * (1 - LEVEL) / 2, 100 * (1 + LEVEL) / 2])
    return Overlap(reviewers, len(same), float(same.mean()), float(low), float(high), float(np.abs(a - b).mean()))


def agreement(ws: Workspace, run: str, reviewer: str | None = None) -> AgreementReport:
    """Every reward scored on `run`'s labelled episodes against the labels (of `reviewer`, or everyone's), and
    each reviewer against each other where they labelled the same groups. KeyError naming the run when it has no
    episodes."""
    batches = list(episode_batches(ws, run))
    with read_views(ws) as con:
        labelled = con.execute(
            "SELECT list(DISTINCT reviewer ORDER BY reviewer), count(DISTINCT rollout_id) FROM label_values "
            "WHERE list_contains($batches, batch_id) AND ($reviewer IS NULL OR reviewer = $reviewer)",
            {"batches": batches, "reviewer": reviewer}).fetchall()[0]
        by_reward = con.sql(
            "SELECT reward_name || '@' || reward_version AS judge, * FROM label_agreement_groups "
            "WHERE list_contains($batches, batch_id) AND ($reviewer IS NULL OR reviewer = $reviewer) "
            "ORDER BY reward_name, reward_version", params={"batches": batches, "reviewer": reviewer}).to_arrow_table().to_pylist()
        by_reviewer = con.sql(
            "SELECT reviewer_b || ' vs ' || reviewer_a AS judge, * FROM reviewer_agreement_groups "
            "WHERE list_contains($batches, batch_id) AND ($reviewer IS NULL OR $reviewer IN (reviewer_a, reviewer_b)) "
            "ORDER BY reviewer_a, reviewer_b", params={"batches": batches, "reviewer": reviewer}).to_arrow_table().to_pylist()
        both = con.execute(
            "SELECT reviewer_a || ' and ' || reviewer_b, list((value_a, value_b)) FROM reviewer_episodes "
            "WHERE list_contains($batches, batch_id) AND ($reviewer IS NULL OR $reviewer IN (reviewer_a, reviewer_b)) "
            "GROUP BY reviewer_a, reviewer_b ORDER BY 1", {"batches": batches, "reviewer": reviewer}).fetchall()
    report = AgreementReport(run, labelled[0] or [], labelled[1])
    report.same_episodes = [overlap(names, [tuple(v) for v in values]) for names, values in both]
    for judges, rows in ((report.rewards, by_reward), (report.between_reviewers, by_reviewer)):
        grouped: dict[str, list[dict[str, Any]]] = {}
        for r in rows:
            grouped.setdefault(r["judge"], []).append(r)
        judges.extend(measure(judge, members) for judge, members in grouped.items())
    return report


# -- output ----------------------------------------------------------------------------------

COLUMNS = ["judge", "groups", "pairs", "accuracy", "interval", "ties", "ranked_groups", "mean_tau", "tau_interval"]


def _interval(low: float | None, high: float | None) -> str:
    return "" if low is None or high is None else f"{low:.3f} to {high:.3f}"


def _row(a: Agreement) -> list[Any]:
    return [a.judge, a.groups, a.pairs, round(a.accuracy, 4), _interval(a.accuracy_low, a.accuracy_high), a.ties,
            a.ranked_groups, None if a.mean_tau is None else round(a.mean_tau, 4), _interval(a.tau_low, a.tau_high)]


OVERLAP_COLUMNS = ["reviewers", "episodes", "same_verdict", "interval", "mean_abs_difference"]


def _overlap_row(o: Overlap) -> list[Any]:
    return [o.reviewers, o.episodes, round(o.same_verdict, 4), _interval(o.low, o.high), round(o.mean_abs_difference, 4)]


def print_agreement(report: AgreementReport, as_json: bool = False) -> None:
    """The report as tables (rewards, then reviewers by pairs, then by episodes), or as JSON lines with `--json`, one
    per row, its `table` saying which: rewards, reviewer_pairs or reviewer_episodes."""
    if as_json:
        import json

        for table, rows in (("rewards", report.rewards), ("reviewer_pairs", report.between_reviewers),
                            ("reviewer_episodes", report.same_episodes)):
            for row in rows:
                print(json.dumps({"run": report.run, "table": table, **asdict(row)}))
        return
    print(f"run {report.run}: {report.labelled} episodes labelled by {', '.join(report.reviewers) or 'nobody yet'}; "
          f"pairwise accuracy and Kendall's tau per reward, {LEVEL:.0%} bootstrap intervals over groups")
    print_rows(COLUMNS, [_row(a) for a in report.rewards])
    if report.between_reviewers:
        print("between reviewers (B vs A: B's labels judged on A's pairs)")
        print_rows(COLUMNS, [_row(a) for a in report.between_reviewers])
    if report.same_episodes:
        print("between reviewers, on the episodes both labelled (verdict: value >= 0.5 is good)")
        print_rows(OVERLAP_COLUMNS, [_overlap_row(o) for o in report.same_episodes])


def agreement_html(report: AgreementReport) -> str:
    """The run page's section: both tables, or a line saying that nobody labelled the run's episodes yet."""
    if not report.rewards and not report.between_reviewers and not report.same_episodes:
        return (f"<p class='meta'>No labelled preferences on this run yet ({report.labelled} episodes labelled): "
                f"<code>rlops review {esc(report.run)}</code> opens the review page.</p>")
    head = "".join(f"<th>{esc(c.replace('_', ' '))}</th>" for c in COLUMNS)

    def table(judges: list[Agreement], kind: str) -> str:
        body = "".join(f"<tr data-judge='{esc(a.judge)}' data-accuracy='{a.accuracy}'>" + "".join(
            f"<td class='{'' if i == 0 else 'num'}'>{esc(fmt(v) if isinstance(v, float) else v)}</td>"
            for i, v in enumerate(_row(a))) + "</tr>" for a in judges)
        return f"<table class='agreement {kind}'><tr>{head}</tr>{body}</table>"

    out = [f"<p class='meta'>{report.labelled} episodes labelled by {esc(', '.join(report.reviewers))}. Pairwise "
           "accuracy: the share of a reviewer's within-group preferences the reward orders the same way (ties count "
           f"half); Kendall's tau per ordered group; {LEVEL:.0%} bootstrap intervals over groups.</p>",
           table(report.rewards, "rewards")]
    if report.between_reviewers:
        out += ["<h3>Between reviewers</h3>", table(report.between_reviewers, "reviewers")]
    if report.same_episodes:
        rows = "".join(f"<tr data-reviewers='{esc(o.reviewers)}'>" + "".join(f"<td>{esc(fmt(v) if isinstance(v, float) else v)}</td>"
                       for v in _overlap_row(o)) + "</tr>" for o in report.same_episodes)
        out += ["<h3>Between reviewers, on the episodes both labelled</h3><table class='agreement overlap'><tr>"
                + "".join(f"<th>{esc(c.replace('_', ' '))}</th>" for c in OVERLAP_COLUMNS) + f"</tr>{rows}</table>"]
    return "".join(out)
