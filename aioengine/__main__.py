"""`aioengine ...` and `python -m aioengine ...`: the CLI (aioengine/cli.py), with Python's
garbage collector off while it starts.

Start-up creates a few million objects that all stay alive (torch's and transformers'
modules, the tokenizer's vocabulary, the model): each collection they trigger walks all
of them and frees nothing. Off until the engine is up, a warm `aioengine serve` was ready
~0.8 s sooner here (imports 2.4-2.8 s -> 1.75 s); once it is up the survivors are frozen
(`gc.freeze`), so later collections skip them too.
"""
from __future__ import annotations

import gc
import sys


def main() -> int:
    gc.disable()
    try:
        from aioengine.cli import main as cli_main

        return cli_main()
    finally:
        gc.enable()


if __name__ == "__main__":
    sys.exit(main())
