"""Label every episode of a run from its ground truth, through the review server's HTTP API (the page's own calls).

    rlops review RUN --port 8700 &
    python bench/label_by_answer.py --url http://127.0.0.1:8700 --reviewer truth
    rlops review agreement RUN --reviewer truth         # `correct` should agree at 1.0, an inverted reward at 0

An episode is graded good (1) when its final answer is right by the task's answer (`metadata.answer`): when the
answer is a number, the last number of the last assistant message equals it; otherwise the two texts are equal
once lowercased and stripped of punctuation and spaces. Any other episode is bad (0). The rule is written here, not
imported from rewards/, so that a reward's agreement with these labels measures the reward.

Not under .ci/loopback on purpose: it talks to a server that already runs, in whatever network it runs in.
`--token` for a server that requires one. Prints one line: how many episodes it graded good and bad.
"""

from __future__ import annotations

import argparse
import re
import string

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def right(answer: object, messages: list[dict]) -> bool:
    """Whether the last assistant message answers `answer` (see the module docstring)."""
    final = next((m for m in reversed(messages) if m["role"] == "assistant"), None)
    if final is None or final.get("tool_calls"):
        return False
    text = final.get("content") or ""
    try:
        expected = float(str(answer).replace(",", ""))
    except ValueError:
        squash = str.maketrans("", "", string.punctuation + string.whitespace)
        return text.lower().translate(squash) == str(answer).lower().translate(squash)
    found = NUMBER.findall(text.replace(",", ""))
    return bool(found) and abs(float(found[-1]) - expected) < 1e-9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True, help="the review server, e.g. http://127.0.0.1:8700")
    ap.add_argument("--reviewer", default="truth")
    ap.add_argument("--token", help="the server's token, when it requires one")
    args = ap.parse_args()

    import httpx

    headers = {"Authorization": f"Bearer {args.token}"} if args.token else {}
    with httpx.Client(base_url=args.url, headers=headers, timeout=120) as client:
        info = client.get("/api/info").raise_for_status().json()
        queue = client.get("/api/queue", params={"order": "step"}).raise_for_status().json()
        counts = {1.0: 0, 0.0: 0}
        for item in queue:
            episode = client.get(f"/api/episodes/{item['rollout_id']}").raise_for_status().json()
            value = 1.0 if right(episode["metadata"].get("answer"), episode["messages"]) else 0.0
            client.post("/api/labels", json={"kind": "grade", "workspace_id": info["workspace_id"], "reviewer": args.reviewer,
                                             "rollout_id": item["rollout_id"], "value": value}).raise_for_status()
            counts[value] += 1
    print(f"{args.reviewer}: graded {len(queue)} episodes of run {info['run']}: {counts[1.0]} good, {counts[0.0]} bad")


if __name__ == "__main__":
    main()
