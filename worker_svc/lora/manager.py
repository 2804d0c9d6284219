"""A worker's LoRA adapters: which it knows (name -> PEFT folder), which it keeps in memory
(the last `max_cpu_loras` used, read again from their folder when needed after that), and
which sit in the model's `max_loras` slots (worker_svc/lora/slots.py; the slot used least
recently is the one reused).

Every step names the adapters its new requests run with (`NewRequestData.lora`: name and
folder, sent again whenever the request is sent again: after a preemption, or to a worker
that replaced a dead one), so a worker needs no other state to serve them: an adapter it
does not know yet is read from its folder then. The scheduler loads an adapter on every
worker of its group (`load`) before any request may name it, which is where a bad folder,
a rank above the maximum or another base model's adapter is refused, and puts at most
`max_loras` adapters in one step.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from protos.step import LoraRef
from worker_svc.lora import LoraConfig
from worker_svc.lora.adapter import AdapterError, LoraAdapter, load_adapter
from worker_svc.lora.slots import attach, write_adapter


class LoraManager:
    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, max_cpu_loras: int) -> None:
        if max_loras < 1 or max_rank < 1 or max_cpu_loras < max_loras:
            raise ValueError(
                f"LoRA needs max_loras >= 1, max_lora_rank >= 1 and "
                f"max_cpu_loras >= max_loras, got {max_loras}, {max_rank}, "
                f"{max_cpu_loras}"
            )
        self.max_loras, self.max_rank, self.max_cpu_loras = max_loras, max_rank, max_cpu_loras
        self.layers = attach(model, max_loras, max_rank)
        self.state = model.lora_state
        self.stage_layers = model.model.layer_range
        self.num_layers = model.config.num_layers
        self.device = next(model.parameters()).device
        self._paths: dict[str, str] = {}
        self._memory: OrderedDict[str, LoraAdapter] = OrderedDict()  # least recent first
        self._slots: OrderedDict[str, int] = OrderedDict()  # adapter -> slot, least recent first

    @classmethod
    def from_config(cls, model: nn.Module, config: LoraConfig) -> LoraManager:
        """The manager, with `config.modules` read and checked (AdapterError names one that
        cannot be served)."""
        manager = cls(model, config.max_loras, config.max_lora_rank, config.max_cpu_loras)
        for name, path in config.modules:
            manager.load(LoraRef(name, path))
        return manager

    @property
    def loaded(self) -> list[str]:
        return sorted(self._paths)

    def load(self, ref: LoraRef) -> LoraAdapter:
        """Reads and checks `ref`'s folder against this rank's model (AdapterError, a
        ValueError, naming what is wrong); it is then known and kept in memory. Loading a
        name again (another folder, or the same one rewritten) replaces it."""
        adapter = load_adapter(ref.name, ref.path, self.max_rank)
        in_slot = self._slots.get(ref.name)
        # Checked as it would be written (shapes, layers), without touching any slot.
        write_adapter(
            self.layers,
            -1,
            adapter,
            self.max_rank,
            self.stage_layers,
            self.num_layers,
            dry_run=True,
        )
        self._paths[ref.name] = ref.path
        self._memory[ref.name] = adapter
        self._memory.move_to_end(ref.name)
        if in_slot is not None:  # its slot holds the old weights
            write_adapter(
                self.layers, in_slot, adapter, self.max_rank, self.stage_layers, self.num_layers
            )
        while len(self._memory) > self.max_cpu_loras:
            self._memory.popitem(last=False)
        return adapter

    def unload(self, name: str) -> bool:
        """Forgets `name` (its slot becomes free); False when it was not known."""
        known = self._paths.pop(name, None) is not None
        self._memory.pop(name, None)
        self._slots.pop(name, None)
        return known

    def prepare(self, refs: list[LoraRef | None]) -> torch.Tensor | None:
        """The step's slot per request (in `refs` order, None = the base model) as int32,
        the adapters put in slots as needed; None when no request has an adapter."""
        names = list(dict.fromkeys(ref.name for ref in refs if ref is not None))
        if not names:
            return None
        if len(names) > self.max_loras:
            raise ValueError(
                f"a step names {len(names)} adapters, above max_loras {self.max_loras}"
            )
        for ref in refs:
            if ref is not None and ref.name not in self._paths:
                self.load(ref)  # sent again to a worker that has not seen it
        slot_of = {name: self._slot(name, set(names)) for name in names}
        return torch.tensor(
            [-1 if ref is None else slot_of[ref.name] for ref in refs], dtype=torch.int32
        )

    def row_slots(self, per_request: torch.Tensor | None, counts: np.ndarray) -> None:
        """Sets the forward's slot per batch row (each request's slot, repeated over its
        rows); None clears it (a step of base-model rows only)."""
        if per_request is None:
            self.state.slots = None
            return
        rows = torch.repeat_interleave(per_request, torch.as_tensor(counts))
        self.state.slots = rows.to(self.device)

    def _slot(self, name: str, in_step: set[str]) -> int:
        slot = self._slots.get(name)
        if slot is not None:
            self._slots.move_to_end(name)
            return slot
        used = set(self._slots.values())
        free = [s for s in range(self.max_loras) if s not in used]
        if free:
            slot = free[0]
        else:
            victim = next(n for n in self._slots if n not in in_step)
            slot = self._slots.pop(victim)
        write_adapter(
            self.layers,
            slot,
            self._adapter(name),
            self.max_rank,
            self.stage_layers,
            self.num_layers,
        )
        self._slots[name] = slot
        return slot

    def _adapter(self, name: str) -> LoraAdapter:
        adapter = self._memory.get(name)
        if adapter is not None:
            self._memory.move_to_end(name)
            return adapter
        try:
            return self.load(LoraRef(name, self._paths[name]))
        except AdapterError as exc:  # its folder changed since it was loaded
            raise AdapterError(f"adapter {name!r} could not be read again: {exc}") from None
