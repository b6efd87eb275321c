"""Run programs a policy wrote, against tests, where nothing escapes: sandbox.pool (the API), sandbox.server (the
template process), sandbox.harness (what runs inside), sandbox.isolate (the kernel calls).

Imports nothing of rlops: rewards (rewards.code) and tasks (the `python` tool) both use it.
"""

from sandbox.pool import Limits, Result, Sandbox, SandboxPool, SandboxUnavailable, shared_pool

__all__ = ["Limits", "Result", "Sandbox", "SandboxPool", "SandboxUnavailable", "shared_pool"]
