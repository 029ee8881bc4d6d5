"""The kernels' AMX modes for the tile tests (cpu_build.set_amx_mode): their names, whether
this machine has the tiles, and `keep_amx_mode`, an autouse fixture a test module imports to
leave the mode as each test found it."""
from __future__ import annotations

import pytest

from aioengine.kernels import cpu_build

OFF, TILES, EMULATED = 0, 1, 2


def restore(mode_name: str | None) -> None:
    """Back to the mode cpu_build.amx_mode() named (None: off)."""
    cpu_build.set_amx_mode({"tiles": TILES, "emulated": EMULATED}.get(mode_name or "", OFF))


def has_tiles() -> bool:
    """The amx build is loaded and the kernel grants the tile state."""
    if cpu_build.variant() != "amx":
        return False
    before = cpu_build.amx_mode()
    try:
        return cpu_build.set_amx_mode(TILES) == "tiles"
    finally:
        restore(before)


@pytest.fixture(autouse=True)
def keep_amx_mode():
    before = cpu_build.amx_mode()
    yield
    restore(before)
