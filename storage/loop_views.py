"""What the deployment loop's tables say together, as SQL views built by `storage.sql.open_views` after the others:

    traffic_lineage   per served call: the rollout batches re-sampled from its scenario (a chat scenario's
                      `scenario_id`, an agent's `input_id`: `rollouts.prompt_id` of the traffic task) and every
                      checkpoint trained on one of them, directly or below one that was (`how`: trained | descendant).
                      "Which models saw this person's data": `SELECT DISTINCT policy_id FROM traffic_lineage WHERE
                      user_id = 'alice'`.
"""

LINEAGE_VIEW = """
WITH RECURSIVE resampled AS (
    SELECT DISTINCT prompt_id, batch_id FROM rollouts WHERE task = 'traffic'
), trained AS (
    SELECT c.policy_id, c.parent_id, c.run_name, c.step, b.batch
    FROM checkpoints c, unnest(CAST(coalesce(json_extract(c.trained_on, '$.batches'), '[]') AS VARCHAR[])) AS b(batch)
), below(root, policy_id, run_name, step, how) AS (
    SELECT policy_id, policy_id, run_name, step, 'trained' FROM checkpoints
    WHERE policy_id IN (SELECT policy_id FROM trained WHERE batch IN (SELECT batch_id FROM resampled))
    UNION
    SELECT below.root, c.policy_id, c.run_name, c.step, 'descendant' FROM below JOIN checkpoints c ON c.parent_id = below.policy_id
)
SELECT t.user_id, t.session_id, t.episode_id, t.call_id, t.scenario_id, r.batch_id, below.policy_id, below.run_name,
       below.step, below.how
FROM traffic t
JOIN resampled r ON r.prompt_id = t.scenario_id OR r.prompt_id = t.input_id
JOIN (SELECT DISTINCT policy_id, batch FROM trained) d ON d.batch = r.batch_id
JOIN below ON below.root = d.policy_id
"""

VIEWS = {"traffic_lineage": LINEAGE_VIEW}
