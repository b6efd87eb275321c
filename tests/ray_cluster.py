"""A real two-node Ray cluster on this machine, for tests and benchmarks.

    with LocalRayCluster(worker_cpus=2) as cluster:      # `ray start --head` + `ray start --address=...`
        cluster.address, cluster.env                     # for a driver: the `ray:` address, the token
        cluster.worker_node_id, cluster.worker_pids()    # where work is expected to run

Both nodes are `ray start --block` processes started here, advertising NODE_IP (`--node-ip-address` on
both), with every port chosen free (other Ray clusters may run on the same machine) and their own temp
folder. NODE_IP is a loopback address that Ray keeps as given: it rewrites 127.0.0.1 and "localhost"
into the machine's interface address before connecting (`services.resolve_ip_for_localhost`), which
would send node-to-GCS traffic past loopback. A driver joining at NODE_IP takes it as its own node
address (stages.cluster.connect). The head has no CPUs, so every task and actor is placed on the worker
node. Ray 2.60 enables token authentication on `ray start`: the cluster gets a fresh random token
through `RAY_AUTH_TOKEN` (never the shared `~/.ray/auth_token`); drivers get it from `env`. Nodes are
stopped by the process groups started here, never by name; each `ray start` also gets SIGTERM when
the process that started it dies (PR_SET_PDEATHSIG), so a killed test run leaves no cluster behind.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from types import TracebackType

from tests.netguard import die_with_parent
from tests.processes import free_port

RAY_BIN = str(Path(sys.executable).with_name("ray"))
NODE_IP = "127.0.0.2"  # as stages.cluster.LOCAL_NODE_IP: loopback, and not rewritten by Ray


class LocalRayCluster:
    def __init__(self, worker_cpus: int = 2, env: dict[str, str] | None = None, timeout_s: float = 180.0):
        self.worker_cpus = worker_cpus
        self.timeout_s = timeout_s
        self.token = uuid.uuid4().hex
        self.port = free_port()
        self.address = f"{NODE_IP}:{self.port}"
        # Short: Ray puts unix sockets under it (107-byte path limit).
        self.temp_dir = Path(tempfile.mkdtemp(prefix="rlray-", dir="/tmp"))
        # No drain on SIGTERM: `stop` signals each node's whole process group, so the head's GCS is gone
        # before its `ray start` asks it to drain the node, and that request waits out the 30 s default.
        self.env = {**os.environ, **(env or {}), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token,
                    "RAY_USAGE_STATS_ENABLED": "0", "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
                    # no idle workers for the first driver: rlops' work carries a runtime_env they lack (stages.cluster)
                    "RAY_prestart_worker_first_driver": "0"}
        self.procs: list[subprocess.Popen] = []
        self.worker_node_id: str | None = None

    def _node_ports(self) -> list[str]:
        args = []
        for flag in ("--node-manager-port", "--object-manager-port", "--metrics-export-port",
                     "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--runtime-env-agent-port"):
            args += [flag, str(free_port())]
        return args

    def _start(self, args: list[str], log: str) -> subprocess.Popen:
        out = open(self.temp_dir / log, "wb")
        proc = subprocess.Popen([RAY_BIN, "start", "--block", f"--node-ip-address={NODE_IP}", "--disable-usage-stats",
                                 *self._node_ports(), *args], env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True,  # own process group: stopped together, by pid
                                preexec_fn=die_with_parent)
        self.procs.append(proc)
        return proc

    def __enter__(self) -> "LocalRayCluster":
        for attempt in (1, 2):
            try:
                self._start(["--head", f"--port={self.port}", "--num-cpus=0", "--include-dashboard=false",
                             f"--temp-dir={self.temp_dir}"], "head.log")
                self._wait_started("head.log")
                self._start([f"--address={self.address}", f"--num-cpus={self.worker_cpus}"], "worker.log")
                self._wait_started("worker.log")
                nodes = self._wait_for(lambda nodes: len(nodes) >= 2)  # registered: one probe, as a rule
                self.worker_node_id = next(n["NodeID"] for n in nodes if n["Resources"].get("CPU", 0) > 0)
                return self
            except BaseException as e:
                self.stop()
                # `ray start` gives its raylet a fixed 30 s to register (ray/_private/node.py): on a
                # loaded machine that can pass. Once, start again on fresh ports; anything else is real.
                if attempt == 2 or "timed out during startup" not in str(e):
                    raise
                self.procs, self.port = [], free_port()
                self.address = f"{NODE_IP}:{self.port}"
                self.temp_dir = Path(tempfile.mkdtemp(prefix="rlray-", dir="/tmp"))
        raise AssertionError("unreachable")

    def _wait_started(self, log: str) -> None:
        """Wait for a `ray start` to print that its node runs (it waits for its raylet to register first): reading
        its log costs nothing, where each probe of `_wait_for` is a Python process importing Ray (seconds of CPU)."""
        deadline = time.monotonic() + self.timeout_s
        while b"Ray runtime started." not in (self.temp_dir / log).read_bytes():
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"ray start exited with {p.returncode}: {self.logs()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"ray start did not start within {self.timeout_s:.0f} s: {self.logs()}")
            time.sleep(0.1)

    def _wait_for(self, ready) -> list[dict]:
        """Poll the cluster's node list (a short-lived driver in a subprocess) until `ready(nodes)`."""
        probe = ("import json, ray; ray.init(address='%s', log_to_driver=False, _node_ip_address='%s'); "
                 "print(json.dumps([n for n in ray.nodes() if n['Alive']], default=str))" % (self.address, NODE_IP))
        deadline = time.monotonic() + self.timeout_s
        while True:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"ray start exited with {p.returncode}: {self.logs()}")
            try:  # a driver retries a missing GCS for a long time: bound each probe
                res = subprocess.run([sys.executable, "-c", probe], env=self.env, capture_output=True, text=True, timeout=60)
            except subprocess.TimeoutExpired as e:
                res = subprocess.CompletedProcess(e.cmd, -1, "", str(e))
            if res.returncode == 0:
                import json

                nodes = json.loads(res.stdout.strip().splitlines()[-1])
                if ready(nodes):
                    return nodes
            if time.monotonic() > deadline:
                raise TimeoutError(f"Ray cluster not ready after {self.timeout_s:.0f} s: {res.stderr[-2000:]}\n{self.logs()}")
            time.sleep(1.0)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in self.temp_dir.glob("*.log"))

    def worker_pids(self) -> set[int]:
        """The worker node's processes: its `ray start` and every descendant (raylet, workers)."""
        import psutil

        proc = psutil.Process(self.procs[1].pid)
        return {proc.pid, *(c.pid for c in proc.children(recursive=True))}

    def stop(self) -> None:
        for p in reversed(self.procs):  # the worker first, then the head
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in reversed(self.procs):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.procs.clear()
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
