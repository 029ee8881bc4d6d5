"""Scale-out on Ray Serve: N engine replicas behind one OpenAI-compatible endpoint, with
prefix-cache affinity routing (docs/scale-out.md).

    aioengine serve --ray-replicas 2                       # a local Ray, or $RAY_ADDRESS
    serve run aioengine.ray_serve:build_app ray-replicas=2   # Ray's own CLI / config files

Needs the `ray` extra (pip install 'aioengine[ray]'). Ray is imported on first use of
`build_app` / `build_application`, so the flags (options.py) parse without it.
"""
from __future__ import annotations

from typing import Any

__all__ = ["build_app", "build_application"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from aioengine.ray_serve import app

        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
