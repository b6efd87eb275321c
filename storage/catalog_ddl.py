"""The catalog's tables (storage/catalog.py): their DuckDB columns, and the columns added since a table was first
made, which an existing catalog gains when a writer next opens it (`ADDED_COLUMNS`, in order, at the end)."""

DDL = {
    "artifacts": """
        artifact_id VARCHAR PRIMARY KEY, kind VARCHAR, stage VARCHAR, status VARCHAR,
        inputs JSON, config_hash VARCHAR, rows BIGINT, meta JSON,
        created_at TIMESTAMPTZ, completed_at TIMESTAMPTZ""",
    "files": """
        path VARCHAR PRIMARY KEY, artifact_id VARCHAR, kind VARCHAR, part VARCHAR,
        rows BIGINT, bytes BIGINT, created_at TIMESTAMPTZ""",
    "checkpoints": """
        policy_id VARCHAR PRIMARY KEY, parent_id VARCHAR, base_model VARCHAR, kind VARCHAR,
        adapter_uri VARCHAR, step INTEGER, trained_on JSON, config_hash VARCHAR,
        mlflow_run_id VARCHAR, run_name VARCHAR, created_at TIMESTAMPTZ""",
    "stage_runs": """
        stage VARCHAR, artifact_id VARCHAR, inputs JSON, config_hash VARCHAR, status VARCHAR,
        started_at TIMESTAMPTZ, finished_at TIMESTAMPTZ, error VARCHAR,
        prefect_flow_run_id VARCHAR, mlflow_run_id VARCHAR, run_name VARCHAR""",
    "runs": """
        run_name VARCHAR PRIMARY KEY, config JSON, mlflow_run_id VARCHAR, status VARCHAR,
        started_at TIMESTAMPTZ, finished_at TIMESTAMPTZ""",
    # One row per champion decision of a registered model (flows/promotion.py): the gate's comparison of the
    # champion and the challenger, the first version, a manual promotion or a rollback.
    "promotions": """
        promotion_id VARCHAR PRIMARY KEY, model_name VARCHAR, action VARCHAR, promoted BOOLEAN, reason VARCHAR,
        champion VARCHAR, champion_version VARCHAR, challenger VARCHAR, challenger_version VARCHAR,
        metric VARCHAR, champion_value DOUBLE, challenger_value DOUBLE, difference DOUBLE, low DOUBLE,
        high DOUBLE, prompts INTEGER, rule VARCHAR, champion_eval VARCHAR, challenger_eval VARCHAR,
        run_name VARCHAR, mlflow_run_id VARCHAR, decided_at TIMESTAMPTZ, judge_version VARCHAR, verdicts VARCHAR""",
    # One row per night of the deployment loop (flows/nightly.py): the traffic window it trained on, where it
    # started and ended, what the gate decided. A night's window is decided once: a resumed night keeps it.
    "nights": """
        night_id VARCHAR PRIMARY KEY, run_name VARCHAR, since TIMESTAMPTZ, until TIMESTAMPTZ, status VARCHAR,
        calls BIGINT, scenarios_train INTEGER, scenarios_heldout INTEGER, start_policy VARCHAR, final_policy VARCHAR,
        promotion_id VARCHAR, promoted BOOLEAN, mlflow_run_id VARCHAR, prefect_flow_run_id VARCHAR,
        started_at TIMESTAMPTZ, finished_at TIMESTAMPTZ, seconds DOUBLE, error VARCHAR""",
    # One row per `rlops traffic forget` (storage/forget.py): what was removed, by count, and the checkpoints that
    # had been trained on the person's scenarios. The subject is kept as a hash, never as the id that was forgotten.
    "forgotten": """
        forget_id VARCHAR PRIMARY KEY, scope VARCHAR, subject_sha256 VARCHAR, traffic_rows BIGINT, feedback_rows BIGINT,
        rollout_rows BIGINT, reward_rows BIGINT, verdict_rows BIGINT, files_rewritten INTEGER, scenarios JSON,
        checkpoints JSON, forgotten_at TIMESTAMPTZ""",
}

PROMOTION_COLUMNS = [c.split()[0] for c in DDL["promotions"].split(",")]

# table -> columns added after the table first shipped, in the order DDL lists them last: `ALTER TABLE ... ADD COLUMN IF
# NOT EXISTS` brings an older catalog to DDL's column order, so positional inserts (`add_promotion`) fit both.
ADDED_COLUMNS = {"promotions": ["judge_version VARCHAR", "verdicts VARCHAR"]}
