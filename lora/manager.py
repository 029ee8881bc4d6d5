"""LoRAManager: the adapters of one engine, from their names to the slots of a step.

    registered  name -> LoRARequest (lora_int_id unique to the load)        [event loop]
    CPU cache   lora_int_id -> LoRAModel, at most max_cpu_loras, LRU       [either side]
    slots       max_loras per wrapped projection, LRU among those a step   [worker]
                does not use; a step never names more than max_loras
                adapters (the scheduler's invariant)

Loading reads and checks the files (off the event loop: `add` blocks); an adapter evicted
from the CPU cache is read again from its path when a step needs it, after checking the
file is the one first loaded. Unloading forgets the name at once (new requests are
refused); requests already holding its LoRARequest keep running on it.
"""
from __future__ import annotations

import itertools
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from aioengine.config import EngineArgs
from aioengine.engine.features import EngineFeature
from aioengine.kernels.cpu_decode import LoRADecodeArgs
from aioengine.lora.adapter import (LoRAError, LoRAModel, LoRANotFoundError, file_stamp,
                                    load_adapter)
from aioengine.lora.kernels import select_lora_kernel
from aioengine.lora.layers import LinearWithLoRA, LoRAStep
from aioengine.lora.request import LoRARequest
from aioengine.model.layers import Linear, ProjectionSpec
from aioengine.model.loader import activation_dtype

if TYPE_CHECKING:
    from aioengine.sched.scheduler_output import SchedulerOutput
    from aioengine.request import Request

logger = logging.getLogger("aioengine")

# Our fused projections and the PEFT modules that are their slices, in output order.
PROJECTION_SLICES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


@dataclass(frozen=True)
class LoRAConfig:
    """The LoRA settings of EngineArgs (built by `from_engine_args`), with its defaults."""
    max_loras: int = EngineArgs.max_loras  # distinct adapters in one step
    max_lora_rank: int = EngineArgs.max_lora_rank
    max_cpu_loras: int | None = EngineArgs.max_cpu_loras  # adapters kept loaded; None: max_loras

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LoRAConfig:
        return cls(max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                   max_cpu_loras=args.max_cpu_loras)

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras})")

    @property
    def cpu_capacity(self) -> int:
        return self.max_cpu_loras or self.max_loras


def slot_dtype(dtype: torch.dtype, device: torch.device, quantization: str | None) -> torch.dtype:
    """The adapter slots' dtype for weights loaded as `dtype` / `quantization`: bfloat16
    where the projections are stored in bfloat16, else the activations' dtype."""
    if quantization is None and dtype == torch.bfloat16:
        return torch.bfloat16
    return activation_dtype(dtype, device)


class LoRAManager(EngineFeature):
    """Created before the model: its `linear_factory` wraps every projection as the model
    builds it, and the model asks it (`lora_source=`) for the fused decode kernel's slots.
    As an EngineFeature it puts each step's adapters in slots on the worker, around the
    forward (begin_execute / end_execute).

        lora = LoRAManager(config, device, dtype, quantization)
        model = load_model(..., linear_factory=lora.linear_factory, lora_source=lora).model
    """

    name = "lora"

    def __init__(self, config: LoRAConfig, device: torch.device, dtype: torch.dtype,
                 quantization: str | None = None) -> None:
        """`dtype` / `quantization`: the weights' as load_model is given them (they decide
        the slots' dtype before the weights exist)."""
        self.config = config
        self.step = LoRAStep()
        self.device = device
        # What adds the adapter updates in the layerwise path (the fused decode has its own).
        self.kernel = select_lora_kernel(device)
        # The slots in the weights' dtype where that is bf16 (the engine's dtype: the adapter
        # weights are read once per token like the model's), else in the activations'.
        self.slot_dtype = slot_dtype(dtype, device, quantization)
        # Every projection of every layer, wrapped once as the model builds it.
        self._wrapped: dict[int, dict[str, LinearWithLoRA]] = {}
        self.module_shapes: dict[tuple[int, str], tuple[int, int]] = {}
        self._table: torch.Tensor | None = None  # the fused kernel's slot pointers, per layer
        self.dtype = self.slot_dtype  # the CPU copies too: one rounding, from float64
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._registered: dict[str, LoRARequest] = {}
        self._stamps: dict[int, tuple[int, int]] = {}  # lora_int_id -> its file when loaded
        self._cpu: OrderedDict[int, LoRAModel] = OrderedDict()  # least recently used first
        self._slot_ids: list[int] = [0] * config.max_loras  # lora_int_id per slot, 0 = empty
        self._slot_last_used: list[int] = [0] * config.max_loras
        self._num_steps = 0
        self.num_loads = self.num_slot_loads = 0
        self._admitting: set[int] = set()  # the adapters of the step being scheduled

    def linear_factory(self, spec: ProjectionSpec, base: Linear) -> LinearWithLoRA:
        """The model's LinearFactory: `base` wrapped with this manager's adapter slots."""
        if spec.name not in PROJECTION_SLICES:
            raise ValueError(f"LoRA: unknown projection {spec.name!r}")
        layer = self._wrapped.setdefault(spec.layer_idx, {})
        if spec.name in layer:
            raise ValueError(f"LoRA: layer {spec.layer_idx} {spec.name} is built twice")
        w = LinearWithLoRA(base, spec.slices, self.config.max_loras, self.config.max_lora_rank,
                           self.step, self.slot_dtype, self.kernel)
        layer[spec.name] = w
        for module, size in zip(PROJECTION_SLICES[spec.name], spec.slices):
            self.module_shapes[(spec.layer_idx, module)] = (w.in_features, size)
        self._table = None
        return w

    @property
    def layers(self) -> list[dict[str, LinearWithLoRA]]:
        """The wrapped projections of each layer, in layer order."""
        return [self._wrapped[i] for i in sorted(self._wrapped)]

    # ---- names (event loop) ---------------------------------------------------------

    def get(self, name: str) -> LoRARequest | None:
        return self._registered.get(name)

    def list_loras(self) -> list[LoRARequest]:
        return list(self._registered.values())

    def resolve(self, lora_request: LoRARequest) -> LoRARequest:
        """The registered adapter a request names (by lora_name), without loading. Raises
        LoRANotFoundError when it is not loaded, LoRAError when it names another path."""
        registered = self._registered.get(lora_request.lora_name)
        if registered is None:
            raise LoRANotFoundError(f"the LoRA adapter {lora_request.lora_name!r} is not loaded")
        if lora_request.lora_path and lora_request.lora_path != registered.lora_path:
            raise LoRAError(f"LoRA adapter {lora_request.lora_name!r} is loaded from "
                            f"{registered.lora_path}, not {lora_request.lora_path}")
        return registered

    def add(self, lora_request: LoRARequest, exist_ok: bool = False) -> LoRARequest:
        """Loads and registers an adapter under its name (blocking: file reads); returns the
        registered LoRARequest with its lora_int_id. Raises LoRAError (already loaded, unless
        `exist_ok`; bad files, rank above max_lora_rank) or LoRANotFoundError (no such path).
        """
        name = lora_request.lora_name
        if name in self._registered and not exist_ok:
            raise LoRAError(f"the LoRA adapter {name!r} has already been loaded")
        if not lora_request.lora_path:
            raise LoRAError(f"LoRA adapter {name!r}: lora_path is required")
        lora_id = next(self._ids)
        model = load_adapter(name, lora_id, lora_request.lora_path, self.module_shapes,
                             self.config.max_lora_rank, self.dtype)
        registered = LoRARequest(name, lora_request.lora_path, lora_id)
        with self._lock:
            if name in self._registered:  # loaded meanwhile by another caller
                if exist_ok:
                    return self._registered[name]
                raise LoRAError(f"the LoRA adapter {name!r} has already been loaded")
            self._cache(model)
            self._registered[name] = registered
            self._stamps[lora_id] = model.stamp
        self.num_loads += 1
        logger.info("LoRA adapter %r loaded from %s: rank %d, %.1f MiB", name,
                    lora_request.lora_path, model.rank, model.nbytes() / 2**20)
        return registered

    def remove(self, name: str) -> LoRARequest | None:
        """Forgets `name` (None if unknown); its CPU copy goes unless a slot holds it."""
        with self._lock:
            registered = self._registered.pop(name, None)
            if registered is not None and registered.lora_int_id not in self._slot_ids:
                self._cpu.pop(registered.lora_int_id, None)
        return registered

    def _cache(self, model: LoRAModel) -> None:
        """Into the CPU cache (lock held), evicting the least recently used beyond its size,
        those not in a slot first."""
        self._cpu[model.lora_id] = model
        self._cpu.move_to_end(model.lora_id)
        while len(self._cpu) > self.config.cpu_capacity:
            idle = [i for i in self._cpu if i not in self._slot_ids and i != model.lora_id]
            victim = idle[0] if idle else next(iter(self._cpu))
            del self._cpu[victim]

    # A sample's adapter is request.lora_request, as registered when the request was
    # prepared (`resolve`): an adapter unloaded since keeps serving the requests that hold
    # it. It is part of the request's identity (its block hashes' cache_salt, the outputs),
    # so the feature keeps no state of its own per request (no admit).

    def draft_pool(self, request: Request) -> int | None:
        """An adapter's outputs draft only for requests with the same adapter (its
        lora_int_id is unique to one load); the base model's for the base model's."""
        return request.lora_id or None

    def allows_tree_drafts(self, request: Request) -> bool:
        """Requests with an adapter are left to the chain path, which is tested with
        adapters."""
        return not request.lora_id

    # ---- the scheduler's hooks (event loop) -------------------------------------------

    def begin_admission(self, running: Sequence[Request]) -> None:
        """The adapters the running requests hold (a step never names more than
        max_loras)."""
        self._admitting = {r.lora_id for r in running if r.lora_id}

    def can_admit(self, request: Request) -> bool:
        """False if the request's adapter would be one more than max_loras in the step."""
        return (not request.lora_id or request.lora_id in self._admitting
                or len(self._admitting) < self.config.max_loras)

    def admitted(self, request: Request) -> None:
        if request.lora_id:
            self._admitting.add(request.lora_id)

    # ---- the step (worker) ------------------------------------------------------------

    def begin_execute(self, scheduler_output: SchedulerOutput) -> None:
        """EngineFeature.begin_execute: the step's adapters into slots (assign_slots)."""
        self.assign_slots([(s.request.lora_request, s.num_new_tokens)
                           for s in scheduler_output.scheduled])

    def end_execute(self, scheduler_output: SchedulerOutput) -> None:
        self.end_step()

    def assign_slots(self, items: list[tuple[LoRARequest | None, int]]) -> None:
        """Puts the step's adapters in slots and sets every token's slot (-1: base);
        `items`: (LoRARequest or None for the base model, its number of tokens), in the
        step's token order."""
        self._num_steps += 1
        slot_of: dict[int, int] = {}
        for lora, _ in items:
            if lora is not None and lora.lora_int_id not in slot_of:
                slot_of[lora.lora_int_id] = self._slot_for(lora, slot_of)
        if not slot_of:
            self.step.clear()
            return
        token_slots: list[int] = []
        for lora, n in items:
            token_slots += [-1 if lora is None else slot_of[lora.lora_int_id]] * n
        self.step.set(token_slots, self.device)

    def end_step(self) -> None:
        self.step.clear()

    def _slot_for(self, lora: LoRARequest, taken: dict[int, int]) -> int:
        lora_id = lora.lora_int_id
        if lora_id in self._slot_ids:
            slot = self._slot_ids.index(lora_id)
        else:
            in_use = set(taken.values())
            free = [s for s in range(len(self._slot_ids)) if s not in in_use]
            if not free:
                raise RuntimeError(f"a step names more than max_loras "
                                   f"({self.config.max_loras}) adapters")
            slot = min(free, key=lambda s: self._slot_last_used[s])
            self._activate(slot, self._model_for(lora))
        self._slot_last_used[slot] = self._num_steps
        return slot

    def _model_for(self, lora: LoRARequest) -> LoRAModel:
        with self._lock:
            model = self._cpu.get(lora.lora_int_id)
            if model is not None:
                self._cpu.move_to_end(lora.lora_int_id)
                return model
        # Evicted from the CPU cache: read again, if the file is still the one loaded.
        if file_stamp(lora.lora_path) != self._stamps.get(lora.lora_int_id):
            raise LoRAError(f"LoRA adapter {lora.lora_name!r}: {lora.lora_path} changed since "
                            f"it was loaded; load it again to use the new weights")
        model = load_adapter(lora.lora_name, lora.lora_int_id, lora.lora_path,
                             self.module_shapes, self.config.max_lora_rank, self.dtype)
        with self._lock:
            if self._registered.get(lora.lora_name) is lora:
                self._cache(model)
        return model

    def _activate(self, slot: int, model: LoRAModel) -> None:
        for i, wrapped in self._wrapped.items():
            for attr, modules in PROJECTION_SLICES.items():
                wrapped[attr].set_slot(slot, [model.weights.get((i, m)) for m in modules])
        self._slot_ids[slot] = model.lora_id
        self.num_slot_loads += 1

    def decode_args(self) -> LoRADecodeArgs | None:
        slots = self.step.token_slots
        if slots is None:
            return None
        if self._table is None:  # built once the model has made every wrapper
            self._table = torch.tensor(
                [[t.data_ptr() for attr in PROJECTION_SLICES
                  for t in (wrapped[attr].lora_a, wrapped[attr].lora_b, wrapped[attr].ranks)]
                 for wrapped in self.layers], dtype=torch.int64)
        return LoRADecodeArgs(self._table, slots, self.config.max_lora_rank,
                              self.slot_dtype == torch.bfloat16)

    # ---- what it holds ----------------------------------------------------------------

    def get_stats(self) -> dict[str, float]:
        with self._lock:
            cpu_bytes = sum(m.nbytes() for m in self._cpu.values())
            num_cpu = len(self._cpu)
        return {"lora_num_registered": len(self._registered), "lora_num_cpu": num_cpu,
                "lora_cpu_bytes": cpu_bytes, "lora_slot_bytes": self.slot_bytes(),
                "lora_num_loads": self.num_loads, "lora_num_slot_loads": self.num_slot_loads}

    def slot_bytes(self) -> int:
        return sum(w.slot_nbytes() for wrapped in self.layers for w in wrapped.values())
