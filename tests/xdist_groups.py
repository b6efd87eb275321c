"""How the suite's tests are spread over xdist workers (a pytest plugin, loaded by tests/conftest.py).

1. **Groups that hold.** Tests that read one expensive thing (a cluster, a run) are marked
   `xdist_group(name)`; with `--dist loadgroup` (pyproject.toml) xdist sends each group to one worker,
   which makes that thing once. Tests that use a module- or package-scoped fixture of the suite are
   grouped by that module or package without a mark: such a fixture is made once per worker its tests
   land on, and `--dist load` spread them over all workers. xdist finds a test's group in a `@name`
   suffix it writes into the node id on the worker (`item._nodeid`); pytest 9.2 keeps node ids in a
   structured `item._id`, so that write has no effect and every group was silently spread over all
   workers, each making the shared thing again (pytest-xdist issue 1386; the views' run was made 3
   times in one suite run). The tests of a session-scoped server fixture (`SERVER_FIXTURES`: the Prefect
   harness) are grouped by its name. Here the suffix is written where pytest 9.2 reads it, and a worker whose
   grouped tests still lack it stops the run with an error instead of going on slowly.
2. **Slow modules first.** xdist hands out groups (largest first), then single tests in collection
   order, to whichever worker is free. On a worker under `-n`, modules holding a test marked `slow` are
   collected ahead of the rest (each module's tests keep their order, so its fixtures are shared as
   before): the long tests start early and the short ones fill the end, instead of a long test starting
   last while the other workers idle (longest-first scheduling). Without `-n` the order is pytest's.
"""

from __future__ import annotations

import pytest


def _marked_group(item: pytest.Item) -> str | None:
    """The item's `xdist_group` marks, as xdist names the group (several: the names sorted, joined by `_`)."""
    names = {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")}
    return "_".join(sorted(names)) if names else None


def _shared_fixture_group(item: pytest.Item) -> str | None:
    """Where the item uses a fixture of the suite's made once per module or package (a served model, a
    trained adapter, a pipeline run), that module's or package's id: its tests are one group, or each
    xdist worker its tests land on would make the fixture again."""
    defs = getattr(item, "_fixtureinfo", None)
    widest = None
    for name in item.fixturenames:
        fixturedef = (defs.name2fixturedefs.get(name) or [None])[-1] if defs else None
        if fixturedef is None or not fixturedef.baseid.startswith("tests"):  # pytest's and plugins' own
            continue
        if fixturedef.scope == "package":
            return fixturedef.baseid
        if fixturedef.scope in ("module", "class"):
            widest = item.nodeid.split("::")[0]
    return widest


# Session-scoped fixtures that start a server: their tests are one group, so one worker starts it once (each
# worker its tests landed on started its own: a Prefect server is ~6 s of CPU to start).
SERVER_FIXTURES = ("prefect_harness",)


def _group(item: pytest.Item) -> str | None:
    return _marked_group(item) or _shared_fixture_group(item) or next(
        (name for name in SERVER_FIXTURES if name in item.fixturenames), None)


def _set_group(item: pytest.Item, group: str) -> None:
    """Write `@group` at the end of the item's node id, where xdist's loadgroup scheduler reads it."""
    if hasattr(item, "_id"):  # pytest >= 9.2: the structured node id
        from _pytest.nodeid import NodeId

        # The parameters folded into the last name: rebuilt from its fields (as reports are), the id
        # reads `name[params]@group`.
        old = item._id
        last = old.names[-1] + (f"[{old.params}]" if old.params is not None else "") + f"@{group}"
        item._id = NodeId(path=old.path, names=(*old.names[:-1], last))
    else:
        item._nodeid = f"{item.nodeid}@{group}"


@pytest.hookimpl(trylast=True)  # after xdist's own suffixing of marked tests, which this repeats where it failed
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not hasattr(config, "workerinput"):
        return  # not an xdist worker: pytest's own order, nothing is sent anywhere
    slow = {item.module for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.module not in slow)  # stable
    if not config.getvalue("loadgroup"):
        return
    groups = {item: _group(item) for item in items}
    for item, group in groups.items():
        if group is not None and not item.nodeid.endswith(f"@{group}"):
            _set_group(item, group)
    lost = [item.nodeid for item, group in groups.items() if group and not item.nodeid.endswith(f"@{group}")]
    if lost:
        raise pytest.UsageError(f"--dist loadgroup: {len(lost)} grouped tests carry no group in their node id "
                                f"(e.g. {lost[0]}), so xdist would spread them over workers; see tests/xdist_groups.py")
