"""`rlops review RUN` (the review server) and `rlops review agreement RUN` (each reward against the labels).

Neither imports anything heavy before its arguments are checked: the server loads a tokenizer on the first episode
it shows (to split the token runs), the agreement report only reads SQL.
"""

from __future__ import annotations

import argparse
import getpass
import sys

from flows.registry import command, guard


@command("review")
@guard
def cmd_review(args: argparse.Namespace) -> int:
    from storage.workspace import Workspace

    if args.what == "agreement" and args.run:
        from flows.views.agreement import agreement, print_agreement

        print_agreement(agreement(Workspace.open(args.workspace), args.run, reviewer=args.reviewer), args.json)
        return 0
    if args.run:
        print("error: `rlops review RUN` serves the review page; `rlops review agreement RUN` measures the rewards "
              "against the labels", file=sys.stderr)
        return 2
    from flows.views.review import Review
    from flows.views.review_app import review_token, serve

    review = Review(Workspace.open(args.workspace), args.what, judge=args.judge, programmatic=args.programmatic)
    return serve(review, args.host, args.port, review_token(args.host, args.token), args.reviewer or _user())


def _user() -> str | None:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container)
        return None


def add_parsers(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("review", parents=[common], help="review a run's episodes in the browser and label them; "
                       "`review agreement RUN`: each reward against the labels")
    p.add_argument("what", metavar="RUN | agreement", help="RUN: serve the review page of the run")
    p.add_argument("run", nargs="?", metavar="RUN", help="after `agreement`: print each reward's agreement with the "
                   "run's labels (pairwise accuracy, Kendall's tau, 95 %% intervals) and between reviewers")
    p.add_argument("--reviewer", help="the page's reviewer name (default: your user name); with agreement: only "
                   "this reviewer's labels")
    p.add_argument("--host", default="127.0.0.1", help="address to serve on; any but loopback requires a token")
    p.add_argument("--port", type=int, default=8700)
    p.add_argument("--token", help="require this token (default: none on loopback, a random one printed otherwise)")
    p.add_argument("--judge", metavar="REWARD", help="the judge of 'disagreements first' (default: the reward whose "
                   "rows carry explanations, as RULER's do)")
    p.add_argument("--programmatic", metavar="REWARD", help="what the judge is compared with (default: the run's "
                   "first scored component that is not the judge or the total)")
