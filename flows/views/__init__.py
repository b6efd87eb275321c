"""What a person reads: episode inspection, run pages, reports and the UI launchers.

inspection (which episodes to read, from SQL), inspect_render (the terminal and the static page),
runpage (run.html), pages (the shared, escaped page shell), report (PNGs + HTML logged to MLflow),
ui (`rlops ui`: Prefect's or MLflow's UI on a workspace). Views read the workspace and call stage
helpers; the flows never import them, only the CLI commands do.
"""
