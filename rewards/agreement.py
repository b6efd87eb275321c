"""How far a judge's ranking agrees with a programmatic reward, on stored rollouts: one SQL query.

    ws.query(AGREEMENT_SQL).to_pylist()[0]       # or paste it into `rlops sql "..."`

GRPO only uses a reward's order within a group (advantages are group-relative), so the question is
whether the judge orders a group's rollouts the way the programmatic reward does. Over every pair
of rollouts of one group that the programmatic reward tells apart (different values):

    pairs        such pairs
    unjudged     pairs where the judge has no value for one of the two (its row is an error)
    concordant   the judge orders the pair the same way
    discordant   the judge orders it the other way
    judge_ties   the judge gives both the same score
    agreement    concordant / (concordant + discordant): ties left out (0.5 is chance)
    agreement_ties_half   ties counted as half agreeing (what a random tie-break would get)
    rho_groups, mean_spearman   Spearman's rho of the two rankings per group (average ranks for
                 ties), averaged over the groups where both rankings vary

The first line names the two rewards; each rollout's newest score of each is used, whatever its
version. It reads only the `rollouts` and `rewards` views, so it runs in `rlops sql`'s sandbox.
docs/REWARDS.md shows this same text (tests/rewards/test_ruler_agreement.py keeps them equal).
"""

AGREEMENT_SQL = """\
WITH names AS (SELECT 'ruler' AS judge, 'correct' AS truth),
latest AS (
    SELECT r.rollout_id, r.reward_name, r.value
    FROM rewards r JOIN names n ON r.reward_name IN (n.judge, n.truth)
    QUALIFY row_number() OVER (PARTITION BY r.rollout_id, r.reward_name ORDER BY r.scored_at DESC) = 1
),
scored AS (
    SELECT ro.batch_id, ro.group_id, ro.rollout_id,
           max(l.value) FILTER (WHERE l.reward_name = n.judge) AS judge,
           max(l.value) FILTER (WHERE l.reward_name = n.truth) AS truth
    FROM rollouts ro JOIN latest l USING (rollout_id) CROSS JOIN names n
    GROUP BY ro.batch_id, ro.group_id, ro.rollout_id
),
pairs AS (
    SELECT sign(a.judge - b.judge) * sign(a.truth - b.truth) AS agree
    FROM scored a JOIN scored b
      ON a.batch_id = b.batch_id AND a.group_id = b.group_id AND a.rollout_id < b.rollout_id
    WHERE a.truth <> b.truth
),
ranks AS (
    SELECT batch_id, group_id,
           rank() OVER (PARTITION BY batch_id, group_id ORDER BY judge)
             + (count(*) OVER (PARTITION BY batch_id, group_id, judge) - 1) / 2 AS judge_rank,
           rank() OVER (PARTITION BY batch_id, group_id ORDER BY truth)
             + (count(*) OVER (PARTITION BY batch_id, group_id, truth) - 1) / 2 AS truth_rank
    FROM scored WHERE judge IS NOT NULL AND truth IS NOT NULL
),
rho AS (
    SELECT corr(judge_rank, truth_rank) AS rho FROM ranks GROUP BY batch_id, group_id
    HAVING var_pop(judge_rank) > 0 AND var_pop(truth_rank) > 0
),
counts AS (
    SELECT count(*) AS pairs,
           count(*) FILTER (WHERE agree IS NULL) AS unjudged,
           count(*) FILTER (WHERE agree > 0) AS concordant,
           count(*) FILTER (WHERE agree < 0) AS discordant,
           count(*) FILTER (WHERE agree = 0) AS judge_ties
    FROM pairs
)
SELECT c.*,
       round(concordant / nullif(concordant + discordant, 0), 4) AS agreement,
       round((concordant + judge_ties / 2) / nullif(concordant + discordant + judge_ties, 0), 4) AS agreement_ties_half,
       (SELECT count(*) FROM rho) AS rho_groups,
       (SELECT round(avg(rho), 4) FROM rho) AS mean_spearman
FROM counts c
"""
