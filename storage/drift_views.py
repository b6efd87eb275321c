"""Judge drift as SQL (rewards/drift.py): the score stage keeps, in each reward set's meta, how far every judge's
scores agreed with every programmatic reward of the batches it scored; `storage.sql.open_views` shows them as

    judge_drift   per reward set (a training step's scoring, a rescore) and (judge, truth) pair: agreement,
                  tied_pairs, pairs, degenerate_groups, with the run and the batches scored.

    SELECT run_name, completed_at, judge, truth, agreement, tied_pairs, degenerate_groups
    FROM judge_drift ORDER BY completed_at      -- a run that starts to fool its judge: agreement falls
"""

DRIFT_VIEW = """
SELECT a.artifact_id AS reward_set_id,
       (SELECT min(s.run_name) FROM stage_runs s WHERE s.artifact_id = a.artifact_id) AS run_name,
       a.completed_at, CAST(a.inputs AS VARCHAR[]) AS batches,
       d.judge, d.truth, d.agreement, d.tied_pairs, CAST(d.pairs AS BIGINT) AS pairs, d.degenerate_groups
FROM artifacts a,
     unnest(CAST(coalesce(json_extract(a.meta, '$.drift'), '[]') AS STRUCT(judge VARCHAR, truth VARCHAR,
            agreement DOUBLE, tied_pairs DOUBLE, pairs DOUBLE, degenerate_groups DOUBLE)[])) AS t(d)
WHERE a.kind = 'reward_set' AND a.status = 'complete'
"""

VIEWS = {"judge_drift": DRIFT_VIEW}
