"""Every benchmark runs where only loopback exists: `enter()` re-runs the calling script under
.ci/loopback (a network and PID namespace of its own, see there) unless it already runs inside one.

    if __name__ == "__main__":
        loopback.enter()   # first: before anything starts Ray, a server or a pipeline
        main()
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

WRAPPER = Path(__file__).resolve().parents[1] / ".ci" / "loopback"


def enter() -> None:
    if os.environ.get("RLOPS_LOOPBACK") == "1":
        return
    os.execv(str(WRAPPER), [str(WRAPPER), sys.executable, *sys.argv])
