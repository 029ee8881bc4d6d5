"""LoRA adapters through Ray Serve's model multiplexing (`--ray-max-adapters-per-replica K`).

The `--lora-modules` adapters are then a catalog: no replica loads them at start-up. The
ingress sends a request that names one with `multiplexed_model_id` set to its name; Ray's
router (and PrefixAffinityRouter, through MultiplexMixin) prefers the replicas that hold
it, then those that hold the fewest. The replica loads it on its first request through a
`serve.multiplexed` function, which keeps at most K per replica and evicts the least
recently used one: Ray drops its handle and calls the handle's `__del__`.

Unloading forgets the adapter's name in the engine at once, so it must not happen while a
request naming it is still being relayed to the replica's app (that request would get a
404). `ReplicaAdapters` therefore counts the relayed requests of each adapter and unloads an
evicted one when its last request has ended; an adapter loaded again before that is kept.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass

from ray import serve

from aioengine.errors import NotFoundError
from aioengine.lora.request import LoRARequest
from aioengine.server.serving_models import LoRAModulePath

logger = logging.getLogger("aioengine.ray_serve")


@dataclass
class _Held:
    in_flight: int = 0
    evicted: bool = False
    unloading: bool = False  # an unload is scheduled


class AdapterHandle:
    """What Ray's multiplexing keeps for a loaded adapter. Ray calls `__del__` on eviction
    (on a thread of its executor): the eviction is handed to the event loop."""

    def __init__(self, adapters: ReplicaAdapters, name: str) -> None:
        self._adapters = adapters
        self.name = name
        self._loop = asyncio.get_running_loop()
        self._evicted = False

    def __del__(self) -> None:
        if self._evicted:
            return
        self._evicted = True
        try:
            self._loop.call_soon_threadsafe(self._adapters.evict, self.name)
        except RuntimeError:  # the loop is closed: the engine is gone with it
            pass


class ReplicaAdapters:
    """The catalog adapters one replica has loaded into its engine (module docstring)."""

    def __init__(self, engine, catalog: Mapping[str, LoRAModulePath],
                 max_per_replica: int) -> None:
        self.engine = engine
        self.catalog = dict(catalog)
        self._held: dict[str, _Held] = {}
        self._unloading: set[asyncio.Task] = set()

        async def load(name: str) -> AdapterHandle:  # Ray keeps its state on a function
            return await self._load(name)

        self.load = serve.multiplexed(max_num_models_per_replica=max_per_replica)(load)

    async def _load(self, name: str) -> AdapterHandle:
        """Ray's multiplexed loader (one load at a time, under Ray's lock)."""
        held = self._held.get(name)
        if held is None:
            module = self.catalog.get(name)
            if module is None:
                raise NotFoundError(f"The model `{name}` does not exist.")
            await self.engine.add_lora(LoRARequest(name, module.path))
            held = self._held[name] = _Held()
            logger.info("loaded LoRA adapter %s (Ray Serve multiplexing)", name)
        held.evicted = False
        return AdapterHandle(self, name)

    async def acquire(self, name: str) -> None:
        """Loads `name` if needed (raises LoRAError, NotFoundError) and holds it in the
        engine until `release(name)`."""
        while True:
            await self.load(name)
            held = self._held.get(name)
            if held is not None:  # not evicted and unloaded in the meantime
                held.in_flight += 1
                return

    def release(self, name: str) -> None:
        held = self._held[name]
        held.in_flight -= 1
        self._unload_if_done(name, held)

    def evict(self, name: str) -> None:
        held = self._held.get(name)
        if held is not None:
            held.evicted = True
            self._unload_if_done(name, held)

    def _unload_if_done(self, name: str, held: _Held) -> None:
        if held.evicted and held.in_flight == 0 and not held.unloading:
            held.unloading = True
            task = asyncio.get_running_loop().create_task(self._unload(name, held))
            self._unloading.add(task)
            task.add_done_callback(self._unloading.discard)

    async def _unload(self, name: str, held: _Held) -> None:
        held.unloading = False
        if not (held.evicted and held.in_flight == 0):  # loaded or used again meanwhile
            return
        del self._held[name]
        try:
            await self.engine.remove_lora(name)  # returns without yielding to the loop
        except NotFoundError:
            return
        logger.info("unloaded LoRA adapter %s (evicted by Ray Serve multiplexing)", name)
