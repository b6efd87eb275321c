"""What a person reads: episode inspection, run pages, reports, the UI launchers, and the review page.

inspection (which episodes to read, from SQL), inspect_render (the terminal and the static page),
runpage (run.html), pages (the shared, escaped page shell), report (PNGs + HTML logged to MLflow),
ui (`rlops ui`: Prefect's or MLflow's UI on a workspace), review / review_app / review_page (`rlops review`: the
review server, its API and page, where people label episodes), agreement (each reward against those labels).
Views read the workspace and call stage helpers; the flows never import them, only the CLI commands do.
"""
