"""Writes README.md's table of supported architectures from the code's registry
(aioengine/model/registry.py), between its arch-table markers.

    .venv/bin/python scripts/gen_arch_table.py          # rewrite README.md
    .venv/bin/python scripts/gen_arch_table.py --check  # exit 1 if README.md is stale
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from aioengine.model.registry import markdown_table

README = Path(__file__).resolve().parent.parent / "README.md"
BEGIN = "<!-- arch-table:begin (scripts/gen_arch_table.py writes this table) -->\n"
END = "<!-- arch-table:end -->\n"


def with_table(text: str, table: str) -> str:
    """`text` with the part between the markers replaced by `table`; ValueError without
    the markers."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"README.md has no {BEGIN.strip()} ... {END.strip()} markers")
    return text[:start + len(BEGIN)] + table + text[end:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if README.md is stale")
    args = parser.parse_args()
    text = README.read_text()
    new = with_table(text, markdown_table())
    if args.check:
        if new != text:
            print("README.md's architecture table is stale: run scripts/gen_arch_table.py")
            return 1
        return 0
    README.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
