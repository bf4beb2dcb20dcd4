"""The recorded allocation stream and its file: stepalloc's JSON-lines trace with each
allocation's site (``module``, ``torch_op``), as the stress tool's ``fit`` reads it.

Layer: data only (no torch). The recorder appends events; ``write`` puts them in a file.

Invariants: addresses are small unique integers, never reused, so a free names exactly one
allocation; every free follows its allocation; step markers nest (``step_begin`` then
``step_end``, never two open); ``size`` > 0 (PyTorch's caching allocator is not called for a
zero-byte storage: ``NativeCachingAllocator::allocate`` skips ``malloc`` when ``size == 0``);
at most ``MAX_ALLOCATIONS`` allocations (``RecordingTooLarge`` past it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

BACKWARD = " (backward)"
# The most allocations one recording takes: three iterations of LLaVA-1.5-7B's recipe ask for
# about 23,000 (docs/fit.md); each costs the recorder a few hundred bytes of host memory, so a
# function that allocates without end is stopped here (a few GiB) instead of filling the host.
MAX_ALLOCATIONS = 8_000_000


class RecordingTooLarge(RuntimeError):
    """The recording passed ``MAX_ALLOCATIONS`` allocations."""


@dataclass
class Alloc:
    addr: int
    size: int
    module: str
    torch_op: str
    stream: int = 0  # 0: the default stream; side streams 1, 2, ... in the order first used
    freed: bool = False


@dataclass
class Trace:
    """Events in order: ("alloc", Alloc) | ("free", addr) | ("begin", phase) | ("end", None)."""

    events: list = field(default_factory=list)
    allocs: dict = field(default_factory=dict)  # addr -> Alloc
    _next_addr: int = 1
    _open_step: str | None = None
    _prefix: int = 0
    live_bytes: int = 0
    peak_live_bytes: int = 0

    def alloc(self, size: int, module: str, torch_op: str, stream: int = 0) -> int:
        addr = self._next_addr
        if addr > MAX_ALLOCATIONS:
            raise RecordingTooLarge(
                f"the recording passed {MAX_ALLOCATIONS:,} allocations (stepalloc.fit._trace.MAX_ALLOCATIONS), the last "
                f"{torch_op or 'an allocation'} in {module or 'code outside any module'}: a training step asks for far "
                "fewer. Does the function allocate without end (a loop that never stops, a list that keeps every "
                "tensor)? Record fewer iterations, or raise the bound."
            )
        self._next_addr += 1
        a = Alloc(addr, size, module, torch_op, stream)
        self.allocs[addr] = a
        self.events.append(("alloc", a))
        self.live_bytes += size
        self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)
        return addr

    def alloc_before(self, size: int, module: str, torch_op: str) -> int:
        """An allocation made before recording began (a weight built outside): placed before
        everything recorded, after the earlier ones of its kind."""
        addr = self.alloc(size, module, torch_op)
        self.events.insert(self._prefix, self.events.pop())
        self._prefix += 1
        return addr

    def free(self, addr: int) -> None:
        a = self.allocs.get(addr)
        if a is None or a.freed:
            return
        a.freed = True
        self.live_bytes -= a.size
        self.events.append(("free", addr))

    def step_begin(self, phase: str) -> None:
        if self._open_step is not None:
            self.step_end()
        self._open_step = phase
        self.events.append(("begin", phase))

    def step_end(self) -> None:
        if self._open_step is not None:
            self._open_step = None
            self.events.append(("end", None))

    # ---- figures ----

    def counts(self) -> dict[str, int]:
        allocs = sum(1 for kind, _ in self.events if kind == "alloc")
        frees = sum(1 for kind, _ in self.events if kind == "free")
        steps = sum(1 for kind, _ in self.events if kind == "begin")
        return {"allocations": allocs, "frees": frees, "steps": steps, "peak_live_bytes": self.peak_live_bytes}

    def allocations(self) -> list[Alloc]:
        return [a for kind, a in self.events if kind == "alloc"]

    def strip_root(self) -> None:
        """Module paths relative to the model: ModTracker names a path from the root module's
        class ("LlamaForCausalLM.model.layers.0"); with one root module, drop it; with several
        (a user's function running more than one model), keep it."""
        roots = {_root(a.module) for a in self.allocs.values()} - {"", "optimizer"}
        if len(roots) != 1:
            return
        root = roots.pop()
        for a in self.allocs.values():
            if _root(a.module) == root:
                rest = a.module[len(root) :]
                a.module = rest[1:] if rest.startswith(".") else rest.strip()

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        with path.open("w") as f:
            for kind, payload in self.events:
                if kind == "alloc":
                    line = {"op": "alloc", "device": 0, "addr": payload.addr, "size": payload.size, "stream": payload.stream}
                    if payload.module:
                        line["module"] = payload.module
                    if payload.torch_op:
                        line["torch_op"] = payload.torch_op
                    f.write(json.dumps(line, separators=(",", ":")) + "\n")
                elif kind == "free":
                    f.write('{"op":"free","device":0,"addr":%d}\n' % payload)
                elif kind == "begin":
                    f.write(json.dumps({"op": "step_begin", "phase": payload}, separators=(",", ":")) + "\n")
                else:
                    f.write('{"op":"step_end"}\n')
        return path


def _root(module: str) -> str:
    return module.split(" ", 1)[0].split(".", 1)[0]


def read_jsonl(path: str | Path) -> list[dict]:
    """The lines of a stepalloc JSON-lines trace (for tests and the fidelity script)."""
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]


def peak_live(lines: list[dict]) -> tuple[int, int]:
    """(peak live bytes, allocations) of a trace's lines."""
    live: dict[int, int] = {}
    cur = peak = n = 0
    for d in lines:
        if d["op"] == "alloc":
            live[d["addr"]] = d["size"]
            cur += d["size"]
            peak = max(peak, cur)
            n += 1
        elif d["op"] == "free" and d["addr"] in live:
            cur -= live.pop(d["addr"])
    return peak, n
