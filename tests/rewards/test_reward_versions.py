"""Reward versions cover the reward's whole reach: each edit that can change values changes the version,
and edits outside the reach do not. Reward files are real files on disk, edited between versions."""

from __future__ import annotations

import importlib.metadata
import shutil
import textwrap
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest

import rewards.builtin
from rewards.base import RewardSpec, load_fn, reward_version
from rewards.reach import ReachWarning, reach

REWARDS = textwrap.dedent(
    '''\
    import functools
    from pathlib import Path

    import helpers
    from helpers import scale
    from rewards.base import reward

    THRESHOLD = 3
    UNUSED = 10
    WORDS = ("yes", "ok")
    LEXICON = Path(__file__).parent / "lexicon.txt"


    def helper(text):
        return len(text) >= THRESHOLD


    def unrelated():
        return "not reached"


    class Counter:
        def count(self, text):
            return sum(w in text for w in WORDS)


    @functools.lru_cache(maxsize=None)
    def cached(text):
        return text.strip()


    @reward(low=0, high=100)
    def r(rollout, k: int = 1):
        text = rollout.messages[-1].content or ""
        return float(helper(cached(text))) + Counter().count(text) + helpers.norm(text) + scale(k)


    @reward(low=0, high=1)
    def with_default(rollout, words=WORDS):
        return float(any(w in (rollout.messages[-1].content or "") for w in words))


    @reward(low=0, high=1)
    def reads_lexicon(rollout):
        return float(rollout.messages[-1].content in LEXICON.read_text().split())


    @reward(low=0, high=1, files=("table.csv",))
    def with_file(rollout):
        return 1.0


    @reward(low=0, high=1)
    def imports_inside(rollout):
        import deeper
        import pyarrow
        return float(deeper.clip(len(rollout.messages)) + len(pyarrow.__version__) * 0)


    def make(limit):
        @reward(low=0, high=1)
        def closed(rollout):
            return float(len(rollout.messages) <= limit)
        return closed


    made = make(4)
    '''
)

HELPERS = textwrap.dedent(
    '''\
    import deeper


    def norm(text):
        return deeper.clip(len(text))


    def scale(k):
        return 0.0 * k


    def elsewhere():
        return "not reached"
    '''
)

DEEPER = "def clip(n):\n    return min(n, 0)\n"


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A user's reward folder: the reward file, a helper module it imports, and one that imports."""
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    (tmp_path / "helpers.py").write_text(HELPERS)
    (tmp_path / "deeper.py").write_text(DEEPER)
    (tmp_path / "lexicon.txt").write_text("yes\nno\n")
    (tmp_path / "table.csv").write_text("a,b\n1,2\n")
    return tmp_path


def version_of(tree: Path, fn: str = "r", **params: object) -> str:
    return reward_version(RewardSpec(fn=f"{tree / 'my_rewards.py'}:{fn}", params=params))


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, old
    path.write_text(text.replace(old, new, 1))


@pytest.mark.parametrize(
    ("file", "old", "new", "changes"),
    [
        ("my_rewards.py", "return len(text) >= THRESHOLD", "return len(text) > THRESHOLD", True),  # a helper
        ("my_rewards.py", "THRESHOLD = 3", "THRESHOLD = 4", True),  # a module constant the helper reads
        ("my_rewards.py", 'WORDS = ("yes", "ok")', 'WORDS = ("yes",)', True),  # ... a method reads
        ("my_rewards.py", "return sum(w in text", "return sum(w.lower() in text", True),  # a class's method
        ("my_rewards.py", "return text.strip()", "return text.lstrip()", True),  # under functools.lru_cache
        ("helpers.py", "return deeper.clip(len(text))", "return deeper.clip(len(text) + 1)", True),  # module.attr
        ("helpers.py", "return 0.0 * k", "return 0.0 * k * k", True),  # from-imported helper
        ("deeper.py", "min(n, 0)", "max(0, min(n, 0))", True),  # two imports away
        ("my_rewards.py", 'return "not reached"', 'return "edited"', False),  # unrelated function, same file
        ("my_rewards.py", "UNUSED = 10", "UNUSED = 11", False),  # unrelated constant
        ("helpers.py", 'return "not reached"', 'return "edited"', False),  # unrelated function, helper module
        ("lexicon.txt", "no", "maybe", False),  # a data file r does not read
    ],
)
def test_an_edit_changes_the_version_exactly_when_it_is_in_reach(tree, file, old, new, changes) -> None:
    before = version_of(tree)
    assert version_of(tree) == before  # deterministic
    edit(tree / file, old, new)
    assert (version_of(tree) != before) is changes


def test_defaults_closures_and_path_constants_are_reached(tree) -> None:
    with_default, lexicon, closed = version_of(tree, "with_default"), version_of(tree, "reads_lexicon"), version_of(tree, "made")
    edit(tree / "my_rewards.py", 'WORDS = ("yes", "ok")', 'WORDS = ("yes", "sure")')
    assert version_of(tree, "with_default") != with_default  # a default argument's value
    edit(tree / "lexicon.txt", "no", "maybe")
    assert version_of(tree, "reads_lexicon") != lexicon  # a Path constant to a data file: its content
    edit(tree / "my_rewards.py", "made = make(4)", "made = make(5)")
    assert version_of(tree, "made") != closed  # a closure cell


def test_imports_inside_the_function_are_followed(tree) -> None:
    found = reach(load_fn(f"{tree / 'my_rewards.py'}:imports_inside"))
    assert "deeper.clip" in found.code and found.libraries == {"pyarrow": importlib.metadata.version("pyarrow")}
    before = version_of(tree, "imports_inside")
    edit(tree / "deeper.py", "min(n, 0)", "min(n, 1)")
    assert version_of(tree, "imports_inside") != before


def test_declared_data_files_enter_by_content(tree) -> None:
    before = version_of(tree, "with_file")
    (tree / "table.csv").touch()  # a new mtime, the same bytes
    assert version_of(tree, "with_file") == before
    (tree / "table.csv").write_text("a,b\n1,3\n")
    assert version_of(tree, "with_file") != before
    (tree / "table.csv").unlink()
    with pytest.raises(ValueError, match="table.csv, which does not exist"):
        version_of(tree, "with_file")


def test_versions_do_not_depend_on_where_the_folder_lives(tree, tmp_path_factory) -> None:
    moved = tmp_path_factory.mktemp("elsewhere") / "rewards"
    shutil.copytree(tree, moved)
    assert version_of(moved) == version_of(tree)


LIBRARY = textwrap.dedent(
    '''\
    import pyarrow as pa
    import pyarrow.compute as pc
    from rewards.base import reward

    @reward(low=0, high=1)
    def r(rollout):
        return float(pc.sum(pa.array([1, 0])).as_py())
    '''
)


def test_libraries_enter_by_distribution_and_version(tmp_path, monkeypatch) -> None:
    path = tmp_path / "lib_reward.py"
    path.write_text(LIBRARY)
    found = reach(load_fn(f"{path}:r"))
    assert found.libraries == {"pyarrow": importlib.metadata.version("pyarrow")}
    assert set(found.code) == {"lib_reward.py.r"}  # pyarrow's own source is never read
    before = reward_version(RewardSpec(fn=f"{path}:r"))

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda dist: "999.0" if dist == "pyarrow" else real(dist))
    assert reward_version(RewardSpec(fn=f"{path}:r")) != before  # an upgrade is a new version


DYNAMIC = textwrap.dedent(
    '''\
    import importlib
    from rewards.base import reward
    import helpers

    def unrelated():
        return 1

    @reward(low=0, high=1)
    def by_eval(rollout):
        return float(eval("1 > 0"))

    @reward(low=0, high=1)
    def by_import(rollout, name: str = "helpers"):
        return float(importlib.import_module(name).scale(1))

    @reward(low=0, high=1)
    def by_getattr(rollout, name: str = "scale"):
        return float(getattr(helpers, name)(1))
    '''
)


@pytest.mark.parametrize(
    ("fn", "reason"),
    [("by_eval", r"calls eval\(\) \(line 10\)"), ("by_import", "importlib.import_module"),
     ("by_getattr", r"getattr\(\) on the module helpers with a computed name")],
)
def test_dynamic_code_is_versioned_conservatively_with_a_warning(tree, fn, reason) -> None:
    (tree / "dynamic.py").write_text(DYNAMIC)
    spec = RewardSpec(fn=f"{tree / 'dynamic.py'}:{fn}")
    with pytest.warns(ReachWarning, match=reason) as caught:
        before = reward_version(spec)
    assert f"reward {fn}" in str(caught[0].message) and "whole module dynamic.py" in str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReachWarning)
        edit(tree / "dynamic.py", "return 1\n", "return 2\n")
        assert reward_version(spec) != before  # the whole module: even an unrelated edit counts
        after = reward_version(spec)
        edit(tree / "helpers.py", 'return "not reached"', 'return "edited"')
        assert reward_version(spec) != after  # ...and every module it references, whole


def test_builtin_rewards_follow_the_same_rule(tmp_path) -> None:
    found = reach(rewards.builtin.numeric_match)
    assert {"rewards.builtin.final_answer", "rewards.builtin.last_number"} <= set(found.code)
    assert "rewards.builtin.NUMBER_RE" in found.values and "rewards.builtin.normalize" not in found.code
    # A copy of the built-ins, edited like a user would edit them: a helper edit reaches every caller.
    copy = tmp_path / "builtin_copy.py"
    copy.write_text(Path(rewards.builtin.__file__).read_text())
    version: Callable[[str], str] = lambda fn: reward_version(RewardSpec(fn=f"{copy}:{fn}"))  # noqa: E731
    before = {fn: version(fn) for fn in ("numeric_match", "exact_match", "length_penalty")}
    edit(copy, "return last.content or \"\"", "return (last.content or \"\").strip()")  # in final_answer
    after = {fn: version(fn) for fn in before}
    assert after["numeric_match"] != before["numeric_match"] and after["exact_match"] != before["exact_match"]
    assert after["length_penalty"] == before["length_penalty"]  # does not call final_answer


def test_the_judge_reaches_its_prompts_and_client() -> None:
    from rewards.ruler import ruler_reward

    found = reach(ruler_reward)
    # the prompts, wherever they are named from (rewards.ruler imports some of rewards.judge_request's)
    assert {"DEFAULT_RUBRIC", "INSTRUCTIONS", "CORRECTION", "REFERENCE", "SCORE_GRID"} <= {
        label.rsplit(".", 1)[-1] for label in found.values}
    assert {"rewards.ruler.rank", "rewards.judge_request.parse_scores", "rewards.judge_request.verdict_format",
            "rewards.judge_client.OpenAIClient"} <= set(found.code)
    assert "httpx" in found.libraries and not found.warnings
