"""An MCP server for tests/tasks/test_mcp.py (stdio by default, `--http --port P` for streamable HTTP).

`search` answers as tests/scripted_model.py's script expects (the scripted model answers only after that
exact text) and appends "<pid> <query>" to the file named by RLOPS_TEST_MCP_LOG, if set, so a test can
tell the call ran on the server; `broken` always raises (an `is_error` result). When the file
named by RLOPS_TEST_MCP_SCHEMA_FILE says "2", `search` takes an extra `k` parameter: a changed schema
under unchanged task params.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mcp.server import MCPServer  # noqa: E402
from mcp.server.mcpserver.exceptions import ToolError  # noqa: E402 - its message reaches the client (a crash's does not)

from tests.scripted_model import TOOL_RESULT, TOOLS  # noqa: E402

server = MCPServer("scripted")
DESCRIPTION = TOOLS[0]["function"]["description"]  # what the scripted model memorised in its system prompt

SCHEMA_FILE = os.environ.get("RLOPS_TEST_MCP_SCHEMA_FILE")
if SCHEMA_FILE and Path(SCHEMA_FILE).read_text().strip() == "2":
    @server.tool(description=DESCRIPTION)
    def search(query: str, k: int = 3) -> str:
        return _answer(query)
else:
    @server.tool(description=DESCRIPTION)
    def search(query: str) -> str:
        return _answer(query)


def _answer(query: str) -> str:
    if os.environ.get("RLOPS_TEST_MCP_LOG"):
        with open(os.environ["RLOPS_TEST_MCP_LOG"], "a") as f:
            f.write(f"{os.getpid()} {query}\n")
    return TOOL_RESULT


@server.tool(description="Always fails.")
def broken(reason: str) -> str:
    raise ToolError(f"broken on purpose: {reason}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--http", action="store_true")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    if args.http:
        server.run("streamable-http", host="127.0.0.1", port=args.port)
    else:
        print("scripted MCP server: serving on stdio", file=sys.stderr, flush=True)  # tests/tasks/test_mcp.py reads where it goes
        server.run()
