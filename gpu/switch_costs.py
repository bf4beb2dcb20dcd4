#!/usr/bin/env python3
"""The colocated switch's component costs on the device, measured with the CUDA driver API
alone (ctypes, no torch, no stepalloc): what one page costs to create, map (cuMemMap plus
cuMemSetAccess), unmap and release, at the VMM granularity (2 MiB) and at tagged regions' big
pages (16 MiB, config.rs's RECOMMENDED big_page_mb); the host link's bandwidth with pinned
buffers each way (cuMemcpyHtoDAsync / DtoHAsync on one stream, the copies a pause and a resume
make); and one small synchronous copy's latency (vLLM's sleep makes one per allocation).

Beside each figure stands the constant the stress tool's colocated cost model uses
(stress/src/workload/colocated/cost.rs, and the simulated device's per-call costs in
src/backend/sim.rs that it reads through the driver-time statistics), so a GPU run checks
them: ``ratio`` is measured / modelled. The constants are read from those files (the bundle
carries them in model/), with the values of 2026-12-06 where a file is not there.

Run by gpu/sleep_check.py's colocated part (``--parts colocated``), or alone:
  python3 switch_costs.py [--pages N] [--big-pages N] [--copy-mb N] [--repeats N] [--json FILE] [--json-stdout]
Over testdrv's host-memory driver the figures are host-memory figures (reported, not judged).
Exit status 0 when every call succeeded, 1 when a driver call failed, 2 on bad input.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import re
import statistics
import sys
import time
from ctypes import POINTER, Structure, byref, c_int, c_size_t, c_ubyte, c_uint, c_uint64, c_ushort, c_void_p
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cudrv import Driver  # noqa: E402

MIB = 1 << 20
GIB = 1 << 30

# The cost model's constants, in seconds and GB/s (10^9 bytes per second): key -> (file, name,
# scale to seconds or GB/s, the value when the file is not there). Read from the files where they
# are (the repository, or the bundle's model/ copy), so that a GPU run checks the model as built.
CONSTANTS = {
    "link_gbps_pcie4": ("cost.rs", "PCIE4_X16_GBPS", 1.0, 25.0),
    "link_gbps_pcie5": ("cost.rs", "PCIE5_X16_GBPS", 1.0, 50.0),
    "sync_copy_latency_s": ("cost.rs", "SYNC_COPY_LATENCY_S", 1.0, 10e-6),
    "vm_unmap_release_s": ("cost.rs", "VM_UNMAP_RELEASE_S", 1.0, 20e-6),  # vLLM's pool, per allocation
    "vm_create_map_s": ("cost.rs", "VM_CREATE_MAP_S", 1.0, 30e-6),
    # The simulated device's per-call costs: stepalloc's side of the model.
    "create_s": ("sim.rs", "COST_CREATE_NS", 1e-9, 20e-6),
    "create_per_gib_s": ("sim.rs", "COST_CREATE_PER_GIB_NS", 1e-9, 5e-6),
    "map_s": ("sim.rs", "COST_MAP_NS", 1e-9, 10e-6),
    "unmap_s": ("sim.rs", "COST_UNMAP_NS", 1e-9, 10e-6),
    "release_s": ("sim.rs", "COST_RELEASE_PHYSICAL_NS", 1e-9, 10e-6),
    "copy_call_s": ("sim.rs", "COST_COPY_CALL_NS", 1e-9, 3e-6),
    # The simulated device's copy rate unless `sim_copy_mb_s` sets it (the colocated loop sets
    # it to --link-gbps).
    "sim_copy_gib_s": ("config.rs", "DEFAULT_SIM_COPY_BYTES_PER_S", 1.0 / GIB, 25.0),
}
SOURCES = {
    "cost.rs": ["stress/src/workload/colocated/cost.rs", "model/cost.rs"],
    "sim.rs": ["src/backend/sim.rs", "model/sim.rs"],
    "config.rs": ["src/config.rs", "model/config.rs"],
}


def rust_constant(text: str, name: str) -> float | None:
    """A `const NAME: f64|u64 = literal;` of a Rust file: a number (underscores allowed) or
    `A << B`; None when absent or another form."""
    m = re.search(rf"\bconst {name}: (?:f64|u64) = ([^;]+);", text)
    if not m:
        return None
    expr = m[1].replace("_", "").strip()
    try:
        if "<<" in expr:
            a, b = (int(x) for x in expr.split("<<"))
            return float(a << b)
        return float(expr)
    except ValueError:
        return None


def load_model(root: Path) -> tuple[dict, dict]:
    """The cost model's constants (CONSTANTS' keys) and where each came from."""
    texts = {}
    for f, candidates in SOURCES.items():
        for rel in candidates:
            if (root / rel).is_file():
                texts[f] = (rel, (root / rel).read_text())
                break
    model, source = {}, {}
    for key, (f, name, scale, default) in CONSTANTS.items():
        value = rust_constant(texts[f][1], name) if f in texts else None
        model[key] = default if value is None else value * scale
        source[key] = f"{texts[f][0]} {name}" if value is not None else f"built-in (no {f} {name})"
    return model, source


MODEL, MODEL_SOURCE = load_model(Path(__file__).resolve().parent.parent)


class MemLocation(Structure):
    _fields_ = [("type", c_int), ("id", c_int)]


class AllocationProp(Structure):  # CUmemAllocationProp
    _fields_ = [
        ("type", c_int),
        ("requestedHandleTypes", c_int),
        ("location", MemLocation),
        ("win32HandleMetaData", c_void_p),
        ("compressionType", c_ubyte),
        ("gpuDirectRDMACapable", c_ubyte),
        ("usage", c_ushort),
        ("reserved", c_ubyte * 4),
    ]


class AccessDesc(Structure):  # CUmemAccessDesc
    _fields_ = [("location", MemLocation), ("flags", c_int)]


ALLOCATION_PINNED, LOCATION_DEVICE, PROT_READWRITE = 1, 1, 3


class Vmm:
    """The driver's virtual-memory, host-allocation and async-copy calls (beside cudrv.Driver's)."""

    def __init__(self, d: Driver):
        f = d._fn
        self.d = d
        self.create = f("cuMemCreate", POINTER(c_uint64), c_size_t, POINTER(AllocationProp), c_uint64)
        self.release = f("cuMemRelease", c_uint64)
        self.map = f("cuMemMap", c_uint64, c_size_t, c_size_t, c_uint64, c_uint64)
        self.set_access = f("cuMemSetAccess", c_uint64, c_size_t, POINTER(AccessDesc), c_size_t)
        self.unmap = f("cuMemUnmap", c_uint64, c_size_t)
        self.reserve = f("cuMemAddressReserve", POINTER(c_uint64), c_size_t, c_size_t, c_uint64, c_uint64)
        self.free_address = f("cuMemAddressFree", c_uint64, c_size_t)
        self.granularity = f("cuMemGetAllocationGranularity", POINTER(c_size_t), POINTER(AllocationProp), c_int)
        self.host_alloc = f("cuMemHostAlloc", POINTER(c_void_p), c_size_t, c_uint)
        self.free_host = f("cuMemFreeHost", c_void_p)
        self.htod_async = f("cuMemcpyHtoDAsync_v2", c_uint64, c_void_p, c_size_t, c_void_p)
        self.dtoh_async = f("cuMemcpyDtoHAsync_v2", c_void_p, c_uint64, c_size_t, c_void_p)

    def check(self, rc: int, what: str) -> None:
        self.d.check(rc, what)


def summary(seconds: list[float]) -> dict:
    return {
        "n": len(seconds),
        "median_us": statistics.median(seconds) * 1e6,
        "mean_us": statistics.fmean(seconds) * 1e6,
        "max_us": max(seconds) * 1e6,
    }


def page_costs(v: Vmm, device: int, page: int, pages: int) -> dict:
    """Each of `pages` pages of `page` bytes created, mapped and given access, then unmapped and
    released, every call timed alone (one address range reserved for all of them)."""
    prop = AllocationProp()
    prop.type, prop.location.type, prop.location.id = ALLOCATION_PINNED, LOCATION_DEVICE, device
    access = AccessDesc()
    access.location.type, access.location.id, access.flags = LOCATION_DEVICE, device, PROT_READWRITE
    base = c_uint64(0)
    v.check(v.reserve(byref(base), page * pages, page, 0, 0), "cuMemAddressReserve")
    t: dict[str, list[float]] = {k: [] for k in ("create", "map", "set_access", "unmap", "release")}
    handles = []
    clock = time.perf_counter
    try:
        for i in range(pages):
            h = c_uint64(0)
            t0 = clock()
            v.check(v.create(byref(h), page, byref(prop), 0), "cuMemCreate")
            t1 = clock()
            handles.append(h.value)
            addr = base.value + i * page
            v.check(v.map(addr, page, 0, h.value, 0), "cuMemMap")
            t2 = clock()
            v.check(v.set_access(addr, page, byref(access), 1), "cuMemSetAccess")
            t3 = clock()
            t["create"].append(t1 - t0)
            t["map"].append(t2 - t1)
            t["set_access"].append(t3 - t2)
        for i, h in enumerate(handles):
            addr = base.value + i * page
            t0 = clock()
            v.check(v.unmap(addr, page), "cuMemUnmap")
            t1 = clock()
            v.check(v.release(h), "cuMemRelease")
            t2 = clock()
            t["unmap"].append(t1 - t0)
            t["release"].append(t2 - t1)
        handles.clear()
    finally:
        for i, h in enumerate(handles):  # after a failure: give back what was made
            v.unmap(base.value + i * page, page)
            v.release(h)
        v.free_address(base.value, page * pages)
    out = {"page_bytes": page, "pages": pages}
    out.update({k: summary(s) for k, s in t.items()})
    # The model's units: a map is cuMemMap + cuMemSetAccess; vLLM's pair costs per allocation.
    med = {k: out[k]["median_us"] * 1e-6 for k in t}
    out["map_and_access_s"] = med["map"] + med["set_access"]
    out["create_map_s"] = med["create"] + out["map_and_access_s"]
    out["unmap_release_s"] = med["unmap"] + med["release"]
    return out


def copy_costs(v: Vmm, nbytes: int, repeats: int) -> dict:
    """Pinned host <-> device bandwidth (one stream, one direction at a time) and one small
    synchronous copy's latency."""
    d = v.d
    dev = c_uint64(0)
    d.check(d.cuMemAlloc(byref(dev), nbytes), "cuMemAlloc")
    host = c_void_p(0)
    stream = c_void_p(0)
    try:
        v.check(v.host_alloc(byref(host), nbytes, 0), "cuMemHostAlloc")
        ctypes.memset(host, 1, nbytes)  # touched: the copies find it warm, as stepalloc's kept buffers
        d.check(d.cuStreamCreate(byref(stream), 1), "cuStreamCreate")
        times: dict[str, list[float]] = {"dtoh": [], "htod": []}
        for _ in range(repeats + 1):  # the first of each direction is warm-up
            for key, fn, args in (
                ("dtoh", v.dtoh_async, (host, dev.value, nbytes, stream)),
                ("htod", v.htod_async, (dev.value, host, nbytes, stream)),
            ):
                t0 = time.perf_counter()
                v.check(fn(*args), f"cuMemcpy{key}Async")
                d.check(d.cuStreamSynchronize(stream), "cuStreamSynchronize")
                times[key].append(time.perf_counter() - t0)
        small = ctypes.create_string_buffer(4096)
        lat = []
        for _ in range(50):
            t0 = time.perf_counter()
            d.check(d.cuMemcpyDtoH(ctypes.cast(small, c_void_p), dev.value, 4096), "cuMemcpyDtoH")
            lat.append(time.perf_counter() - t0)
    finally:
        if stream.value:
            d.cuStreamDestroy(stream)
        if host.value:
            v.free_host(host)
        d.cuMemFree(dev.value)
    out: dict = {"bytes": nbytes, "repeats": repeats}
    for key in ("dtoh", "htod"):
        s = statistics.median(times[key][1:])
        out[f"{key}_s"] = s
        out[f"{key}_gbps"] = nbytes / s / 1e9
        out[f"{key}_gib_s"] = nbytes / s / GIB
    out["sync_copy_4k_s"] = statistics.median(lat)
    return out


def compare(pages: dict, big: dict | None, copies: dict) -> list[dict]:
    """Each measured cost beside the model's constant it checks (ratio measured / modelled)."""
    m = MODEL
    rows = [
        ("create a 2 MiB page", pages["create"]["median_us"] * 1e-6, m["create_s"], "sim.rs COST_CREATE_NS"),
        ("map + set access a 2 MiB page", pages["map_and_access_s"], m["map_s"], "sim.rs COST_MAP_NS"),
        ("unmap a 2 MiB page", pages["unmap"]["median_us"] * 1e-6, m["unmap_s"], "sim.rs COST_UNMAP_NS"),
        ("release a 2 MiB page", pages["release"]["median_us"] * 1e-6, m["release_s"],
         "sim.rs COST_RELEASE_PHYSICAL_NS"),
        ("create + map (vLLM, per allocation)", pages["create_map_s"], m["vm_create_map_s"], "cost.rs VM_CREATE_MAP_S"),
        ("unmap + release (vLLM, per allocation)", pages["unmap_release_s"], m["vm_unmap_release_s"],
         "cost.rs VM_UNMAP_RELEASE_S"),
        ("synchronous 4 KiB copy", copies["sync_copy_4k_s"], m["sync_copy_latency_s"], "cost.rs SYNC_COPY_LATENCY_S"),
    ]  # fmt: skip
    if big is not None:
        mb = big["page_bytes"] // MIB
        rows += [
            (f"create a {mb} MiB page", big["create"]["median_us"] * 1e-6, m["create_s"], "sim.rs COST_CREATE_NS"),
            (f"map + set access a {mb} MiB page", big["map_and_access_s"], m["map_s"], "sim.rs COST_MAP_NS"),
            (f"unmap a {mb} MiB page", big["unmap"]["median_us"] * 1e-6, m["unmap_s"], "sim.rs COST_UNMAP_NS"),
            (f"release a {mb} MiB page", big["release"]["median_us"] * 1e-6, m["release_s"],
             "sim.rs COST_RELEASE_PHYSICAL_NS"),
        ]  # fmt: skip
    out = [
        {"what": w, "measured_s": got, "model_s": want, "ratio": got / want, "constant": c} for w, got, want, c in rows
    ]
    links = {"PCIE4_X16_GBPS": m["link_gbps_pcie4"], "PCIE5_X16_GBPS": m["link_gbps_pcie5"]}
    for key, label in (("dtoh", "device to host"), ("htod", "host to device")):
        got = copies[f"{key}_gbps"]
        nearest = min(links, key=lambda k: abs(links[k] - got))
        out.append(
            {
                "what": f"pinned copy {label}, GB/s",
                "measured_gbps": got,
                "model_gbps": list(links.values()),
                "nearest": nearest,
                "ratio": got / links[nearest],
                "constant": "cost.rs PCIE4_X16_GBPS / PCIE5_X16_GBPS",
            }
        )
    return out


def measure(pages: int, big_pages: int, copy_bytes: int, repeats: int) -> dict:
    d = Driver()
    d.check(d.cuInit(0), "cuInit")
    dev = c_int(0)
    d.check(d.cuDeviceGet(byref(dev), 0), "cuDeviceGet")
    ctx = c_void_p(0)
    d.check(d.cuDevicePrimaryCtxRetain(byref(ctx), dev.value), "cuDevicePrimaryCtxRetain")
    d.check(d.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    v = Vmm(d)
    prop = AllocationProp()
    prop.type, prop.location.type, prop.location.id = ALLOCATION_PINNED, LOCATION_DEVICE, dev.value
    gran = c_size_t(0)
    v.check(v.granularity(byref(gran), byref(prop), 0), "cuMemGetAllocationGranularity")
    small = page_costs(v, dev.value, gran.value, pages)
    big = page_costs(v, dev.value, 16 * MIB, big_pages) if big_pages else None
    copies = copy_costs(v, copy_bytes, repeats)
    return {
        "granularity": gran.value,
        "pages": small,
        "big_pages": big,
        "copy": copies,
        "model": MODEL,
        "model_source": MODEL_SOURCE,
        "compare": compare(small, big, copies),
    }


def text(doc: dict) -> str:
    lines = ["switch component costs on the device (driver API; median of each call):"]
    lines.append(f"  {'':42} {'measured':>12} {'model':>10} {'ratio':>7}  constant")
    for r in doc["compare"]:
        if "measured_s" in r:
            lines.append(
                f"  {r['what']:42} {r['measured_s'] * 1e6:>9.1f} us {r['model_s'] * 1e6:>7.1f} us "
                f"{r['ratio']:>7.2f}  {r['constant']}"
            )
        else:
            lines.append(
                f"  {r['what']:42} {r['measured_gbps']:>7.1f} GB/s {' / '.join(f'{g:g}' for g in r['model_gbps']):>10} "
                f"{r['ratio']:>7.2f}  "
                f"{r['constant']} (nearest {r['nearest']})"
            )
    c = doc["copy"]
    lines.append(
        f"  (copies of {c['bytes'] / MIB:.0f} MiB: out {c['dtoh_gib_s']:.2f} GiB/s, back {c['htod_gib_s']:.2f} GiB/s; "
        f"pages: {doc['pages']['pages']} of {doc['granularity'] / MIB:.0f} MiB"
        + (f", {doc['big_pages']['pages']} of 16 MiB" if doc.get("big_pages") else "")
        + ")"
    )
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=256, help="2 MiB pages timed (default 256)")
    ap.add_argument("--big-pages", type=int, default=32, help="16 MiB pages timed (default 32; 0: none)")
    ap.add_argument("--copy-mb", type=int, default=1024, help="bytes of each timed copy (default 1024 MiB)")
    ap.add_argument("--repeats", type=int, default=3, help="timed copies each way after a warm-up (default 3)")
    ap.add_argument("--json", help="the figures written to this file")
    ap.add_argument("--json-stdout", action="store_true", help="the figures as the last line of the output")
    a = ap.parse_args()
    if not (1 <= a.pages <= 65536 and 0 <= a.big_pages <= 8192 and 1 <= a.copy_mb <= 65536 and 1 <= a.repeats <= 100):
        ap.error("--pages 1..65536, --big-pages 0..8192, --copy-mb 1..65536, --repeats 1..100")
    try:
        doc = measure(a.pages, a.big_pages, a.copy_mb * MIB, a.repeats)
    except RuntimeError as e:
        print(f"switch_costs: {e}", file=sys.stderr)
        return 1
    print(text(doc), end="")
    if a.json_stdout:
        print(json.dumps(doc), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
