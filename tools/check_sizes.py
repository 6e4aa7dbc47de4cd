"""Sizes of pg2delta's code: modules over 600 lines, classes over 250, functions over 60.

    python tools/check_sizes.py                 # every one over its limit, largest first
    python tools/check_sizes.py --baseline FILE # `make lint`: fails on one not in FILE, or grown past it

A baseline line is ``kind name lines``, as this script prints them; it lists what is over its limit
today, so that nothing new goes over and nothing listed grows, while the list is worked down (write
it anew with ``--write-baseline FILE``). The generated OID table and the C extension are not counted.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "pg2delta"
LIMITS = {"module": 600, "class": 250, "function": 60}
EXEMPT = {"src/pg2delta/decode/_oids.py"}  # generated (tools/update_oids.py)


def sizes() -> Iterator[tuple[str, str, int]]:
    """(kind, name, lines) of every module, class and function of the package."""
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in EXEMPT:
            continue
        text = path.read_text()
        yield "module", rel, len(text.splitlines())
        stack: list[tuple[ast.AST, str]] = [(ast.parse(text), rel)]
        while stack:
            node, prefix = stack.pop()
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                    name = f"{prefix}:{child.name}" if prefix == rel else f"{prefix}.{child.name}"
                    start = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                    kind = "class" if isinstance(child, ast.ClassDef) else "function"
                    yield kind, name, (child.end_lineno or child.lineno) - start + 1
                    stack.append((child, name))
                else:
                    stack.append((child, prefix))


def over() -> list[tuple[str, str, int]]:
    found = [(k, n, lines) for k, n, lines in sizes() if lines > LIMITS[k]]
    return sorted(found, key=lambda f: (list(LIMITS).index(f[0]), -f[2], f[1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", type=Path, help="fail only on what this list does not hold, or holds smaller")
    ap.add_argument("--write-baseline", type=Path, help="write what is over its limit today to this file")
    args = ap.parse_args()
    found = over()
    if args.write_baseline:
        args.write_baseline.write_text("".join(f"{k} {n} {lines}\n" for k, n, lines in found))
        return 0
    if args.baseline is None:
        for k, n, lines in found:
            print(f"{k} {n} {lines} (limit {LIMITS[k]})")
        print(f"{len(found)} over their limit", file=sys.stderr)
        return 0
    allowed = {}
    for line in args.baseline.read_text().splitlines():
        if line.strip():
            k, n, lines = line.split()
            allowed[(k, n)] = int(lines)
    bad = [(k, n, lines) for k, n, lines in found if lines > allowed.get((k, n), LIMITS[k])]
    for k, n, lines in bad:
        was = allowed.get((k, n))
        why = f"was {was}" if was is not None else f"limit {LIMITS[k]}"
        print(f"{k} {n} is {lines} lines ({why}): split it", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
