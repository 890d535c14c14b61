"""The longest functions in vllm_ctxmgr (issue 27's measure): lines from `def` to the body's last line.

A function is counted on its own (a nested function is also listed under its own name and counted inside
its parent too), so the list shows where one name holds too many stages. Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "vllm_ctxmgr"


def function_lengths(package: Path) -> list[tuple[int, str]]:
    """(lines, "path:line name") for every function and method in the package."""
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno is not None
                length = node.end_lineno - node.lineno + 1
                found.append((length, f"{path.relative_to(REPO)}:{node.lineno} {node.name}"))
    return sorted(found, key=lambda row: (-row[0], row[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--top", type=int, default=10, help="how many to list (default 10)")
    top = parser.parse_args().top
    for length, where in function_lengths(PACKAGE)[:top]:
        print(f"{length:5d}  {where}")


if __name__ == "__main__":
    main()
