"""doc_search's `search` and `read` served over MCP (the official `mcp` SDK): the same knowledge base
(tasks/data/kb_docs.jsonl) and the same BM25 as tasks/doc_search.py, so an `mcp` task trained on it
sees exactly the built-in task's tool results.

    python examples/doc_search_mcp/server.py                       # stdio (what `server: {command: ...}` starts)
    python examples/doc_search_mcp/server.py --http --port 8765    # streamable HTTP on 127.0.0.1:8765/mcp

configs/doc_search_mcp.yaml trains on it with GRPO.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the rlops checkout this example lives in

from mcp.server import MCPServer  # noqa: E402

from tasks.doc_search import DATA, TOOL_SPECS, load_jsonl, make_tools  # noqa: E402

DESCRIPTIONS = {s["function"]["name"]: s["function"]["description"] for s in TOOL_SPECS}


def build(k: int = 3) -> MCPServer:
    """The MCP server: `k` results per search, as doc_search's `k`."""
    tools = make_tools(load_jsonl(DATA / "kb_docs.jsonl"), k)
    server = MCPServer("doc_search")

    @server.tool(description=DESCRIPTIONS["search"])
    def search(query: str) -> str:
        return tools["search"](query)

    @server.tool(description=DESCRIPTIONS["read"])
    def read(doc_id: str) -> str:
        return tools["read"](doc_id)

    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--http", action="store_true", help="serve streamable HTTP instead of stdio")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--k", type=int, default=3, help="results per search")
    args = parser.parse_args()
    server = build(args.k)
    if args.http:
        server.run("streamable-http", host=args.host, port=args.port)
    else:
        server.run()


if __name__ == "__main__":
    main()
