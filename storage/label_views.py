"""What people's labels say, as SQL views over the registered label files (storage/labels.py writes them), built by
`storage.sql.open_views` in this order, so `rlops sql`, the review server and `rlops review agreement` read the same:

    labels                  every row ever written, with `current`: the reviewer's latest on its episode (a grade)
                            or its group (an ordering)
    label_values            one value per (reviewer, episode) from the current labels: where the reviewer ordered
                            the episode's group, its place in the ordering, (n - rank) / (n - 1); else its grade
    label_pairs             the preferences those values express: within one group and one reviewer, `preferred`
                            has the higher value (ties express none)
    label_agreement_groups  per reward name@version, reviewer and group: the reviewer's pairs the reward orders the
                            same way (concordant), the other way (discordant) or not at all (ties), and for an
                            ordered group Kendall's tau-b between the ordering and the reward
    label_agreement         the same per reward name@version over the workspace: pairwise accuracy (ties count half)
                            and the mean tau (flows/views/agreement.py adds intervals, per run)
    reviewer_agreement_groups  per (reviewer_a, reviewer_b, group): reviewer_b's values judged against reviewer_a's
                            pairs, as a reward is
    reviewer_episodes       per (reviewer_a < reviewer_b, episode both labelled): their two values
"""

# Which rows are current: the latest submission of a reviewer on an episode (grades) or a group (orderings).
LABELS_VIEW = """
SELECT *, submission_id = first_value(submission_id) OVER (
    PARTITION BY reviewer, kind, CASE WHEN kind = 'grade' THEN rollout_id ELSE batch_id || chr(0) || group_id END
    ORDER BY created_at DESC, submission_id DESC) AS current
FROM _labels_rows
"""

# A reviewer's ordering of a group decides the values of that group's episodes, whatever they graded there: an
# ordering is the relative judgement GRPO and DPO use, and mixing its ranks with grades would compare two scales.
LABEL_VALUES_VIEW = """
WITH cur AS (SELECT * FROM labels WHERE current)
SELECT reviewer, rollout_id, batch_id, group_id, kind, value, rank, created_at FROM cur WHERE kind = 'order'
UNION ALL
SELECT g.reviewer, g.rollout_id, g.batch_id, g.group_id, g.kind, g.value, g.rank, g.created_at FROM cur g
WHERE g.kind = 'grade' AND NOT EXISTS (SELECT 1 FROM cur o WHERE o.kind = 'order' AND o.reviewer = g.reviewer
                                       AND o.batch_id = g.batch_id AND o.group_id = g.group_id)
"""

LABEL_PAIRS_VIEW = """
SELECT a.reviewer, a.batch_id, a.group_id, a.kind, a.rollout_id AS preferred, b.rollout_id AS other,
       a.value - b.value AS margin
FROM label_values a JOIN label_values b USING (reviewer, batch_id, group_id)
WHERE a.value > b.value
"""

# Per group: C concordant, D discordant, T tied pairs out of n. Kendall's tau-b of an ordering (no ties on the
# person's side) against the judge's values is (C - D) / sqrt(n * (n - T)); undefined when the judge ties them all.
_COUNTS = """count(*) AS pairs, count(*) FILTER (WHERE s > 0) AS concordant, count(*) FILTER (WHERE s < 0) AS discordant,
       count(*) FILTER (WHERE s = 0) AS ties,
       CASE WHEN any_value(kind) = 'order' AND count(*) FILTER (WHERE s <> 0) > 0
            THEN (count(*) FILTER (WHERE s > 0) - count(*) FILTER (WHERE s < 0))
                 / sqrt(count(*) * count(*) FILTER (WHERE s <> 0)) END AS kendall_tau"""

# Each rollout's newest row of each reward version (a forced rescore writes a version twice); errors left out.
LABEL_AGREEMENT_GROUPS_VIEW = f"""
WITH scores AS (
    SELECT rollout_id, reward_name, reward_version, value FROM rewards
    QUALIFY row_number() OVER (PARTITION BY rollout_id, reward_name, reward_version ORDER BY scored_at DESC) = 1),
judged AS (
    SELECT p.reviewer, p.batch_id, p.group_id, p.kind, x.reward_name, x.reward_version, sign(x.value - y.value) AS s
    FROM label_pairs p JOIN scores x ON x.rollout_id = p.preferred
    JOIN scores y ON y.rollout_id = p.other AND y.reward_name = x.reward_name AND y.reward_version = x.reward_version
    WHERE x.value IS NOT NULL AND y.value IS NOT NULL)
SELECT reward_name, reward_version, reviewer, batch_id, group_id, any_value(kind) AS kind,
       {_COUNTS}
FROM judged GROUP BY reward_name, reward_version, reviewer, batch_id, group_id
"""

LABEL_AGREEMENT_VIEW = """
SELECT reward_name, reward_version, count(DISTINCT (batch_id, group_id)) AS groups, sum(pairs) AS pairs,
       sum(concordant) AS concordant, sum(discordant) AS discordant, sum(ties) AS ties,
       (sum(concordant) + sum(ties) / 2) / sum(pairs) AS pairwise_accuracy,
       count(kendall_tau) AS ranked_groups, avg(kendall_tau) AS mean_kendall_tau
FROM label_agreement_groups GROUP BY reward_name, reward_version
"""

REVIEWER_AGREEMENT_GROUPS_VIEW = f"""
WITH judged AS (
    SELECT p.reviewer AS reviewer_a, x.reviewer AS reviewer_b, p.batch_id, p.group_id, p.kind, sign(x.value - y.value) AS s
    FROM label_pairs p JOIN label_values x ON x.rollout_id = p.preferred AND x.reviewer <> p.reviewer
    JOIN label_values y ON y.rollout_id = p.other AND y.reviewer = x.reviewer)
SELECT reviewer_a, reviewer_b, batch_id, group_id, any_value(kind) AS kind,
       {_COUNTS}
FROM judged GROUP BY reviewer_a, reviewer_b, batch_id, group_id
"""

# Two reviewers' values of the same episodes, whether or not those make pairs (a held-out episode is a group of one).
REVIEWER_EPISODES_VIEW = """
SELECT a.reviewer AS reviewer_a, b.reviewer AS reviewer_b, a.rollout_id, a.batch_id, a.group_id,
       a.value AS value_a, b.value AS value_b
FROM label_values a JOIN label_values b ON a.rollout_id = b.rollout_id AND a.reviewer < b.reviewer
"""

# name -> SQL, created in this order over the `_labels_rows` view of the registered files (storage.sql.open_views).
VIEWS = {"labels": LABELS_VIEW, "label_values": LABEL_VALUES_VIEW, "label_pairs": LABEL_PAIRS_VIEW,
         "label_agreement_groups": LABEL_AGREEMENT_GROUPS_VIEW, "label_agreement": LABEL_AGREEMENT_VIEW,
         "reviewer_agreement_groups": REVIEWER_AGREEMENT_GROUPS_VIEW, "reviewer_episodes": REVIEWER_EPISODES_VIEW}
