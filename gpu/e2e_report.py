"""The end-to-end comparison's findings (e2e_compare.py): the targets met or missed, and the
text report of every configuration side by side with the replay of the native snapshot, the
prediction made on the CPU and what it assumes beside what the device showed (e2e_predict.py)."""

from __future__ import annotations

from e2e_common import CONFIGS, GIB, MIB
from e2e_model import SIZES
from e2e_predict import ASSUMED_OUTSIDE_MB, GOAL


def gib(v) -> str:
    """Bytes in GiB, or in MiB below 0.1 GiB (the dry run's tiny model)."""
    if v is None:
        return "-"
    return f"{v / GIB:.2f} GiB" if v >= GIB // 10 else f"{v / MIB:.2f} MiB"


def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def evaluate(res: dict) -> list[dict]:
    """The end-to-end loop's targets: met, missed or not measurable."""
    n, x, s = res.get("native", {}), res.get("native_expandable", {}), res.get("stepalloc", {})
    m = res.get("stepalloc_mempool", {})

    def target(name, ok, detail):
        return {"target": name, "status": "n/a" if ok is None else ("MET" if ok else "MISSED"), "detail": detail}

    def both(*vals):
        return all(v is not None for v in vals)

    pr, px, ps = n.get("peak_reserved"), x.get("peak_reserved"), s.get("peak_reserved")
    tn, ts = n.get("median_step_s"), s.get("median_step_s")
    hn, hx, hs = (r.get("headroom", {}).get("largest_batch") for r in (n, x, s))
    pm, dm, ds = m.get("peak_reserved"), m.get("peak_device_used"), s.get("peak_device_used")
    return [
        target(
            "peak reserved >= 15% below native",
            ps <= 0.85 * pr if both(pr, ps) else None,
            f"stepalloc {gib(ps)} vs native {gib(pr)}",
        ),
        target(
            "peak reserved not above native expandable",
            ps <= px if both(px, ps) else None,
            f"stepalloc {gib(ps)} vs expandable {gib(px)}",
        ),
        target(
            "median step time within 2% of native",
            ts <= 1.02 * tn if both(tn, ts) else None,
            f"stepalloc {fmt(ts, '.3f')} s vs native {fmt(tn, '.3f')} s",
        ),
        target(
            # Autograd's thread follows use_mem_pool (stepalloc.follow): one cache, not two.
            "MemPool mode's peak within 2% of process-wide stepalloc",
            pm <= 1.02 * ps if both(pm, ps) else None,
            f"mempool {gib(pm)} vs stepalloc {gib(ps)} reserved; driver peak used {gib(dm)} vs {gib(ds)}",
        ),
        target(
            "headroom above both native configurations",
            hs > max(hn, hx) if both(hn, hx, hs) else None,
            f"largest batch: stepalloc {hs}, native {hn}, expandable {hx}",
        ),
    ]


def answer(res: dict) -> str:
    """The seed's question: does the loop fit under stepalloc where it runs out of memory under
    PyTorch? From the base batch's runs and the largest batches found."""
    n, s, x = res.get("native", {}), res.get("stepalloc", {}), res.get("native_expandable", {})
    if (not n.get("iterations") and "oom" not in n) or (not s.get("iterations") and "oom" not in s):
        return "not measured (PyTorch's or stepalloc's run did not complete)"
    if "oom" in n and "oom" not in s:
        return f"yes: the base batch ({n['oom']['batch']}) runs out of memory under PyTorch and fits under stepalloc"
    if "oom" in s:
        return f"no: the base batch ({s['oom']['batch']}) runs out of memory under stepalloc"
    hn, hs, hx = (r.get("headroom", {}).get("largest_batch") for r in (n, s, x))
    if hn is None or hs is None:
        return "the base batch fits under both; the largest batch was not measured (no headroom search)"
    more = "" if s["headroom"].get("exact") else " or more"
    also = f", expandable segments {hx}" if hx is not None else ""
    if hs > hn:
        return (
            f"yes: batch {hn + 1}{'' if hs == hn + 1 else f'-{hs}'} fits under stepalloc and runs out of memory "
            f"under PyTorch (largest batch: stepalloc {hs}{more}, PyTorch {hn}{also})"
        )
    return f"no difference at this size: largest batch stepalloc {hs}{more}, PyTorch {hn}{also}"


def text_report(doc: dict) -> str:
    res, lines = doc["configs"], []
    names = [c for c in CONFIGS if c in doc["order"] and c != "native_record"]
    first = next((r for r in res.values() if "params" in r), {})
    lines.append(f"stepalloc end-to-end comparison, {doc['date']}, device: {doc['device_name']}")
    lines.append(
        f"model: LLaVA-style (CLIP vision tower + Llama), {first.get('params', 0) / 1e9:.3g} B params, bf16, "
        f"random weights; size '{doc['size']}'; torch {first.get('torch', '?')}, transformers "
        f"{first.get('transformers', '?')}"
    )
    train = doc.get("train")
    if train:
        lines.append(
            f"training: {'full fine-tuning' if train['variant'] == 'full' else 'LoRA on the frozen base'} "
            f"({train.get('trainable_params', 0) / 1e6:.1f} M trainable): {train['why']}"
        )
    lines.append("")
    rows = [
        ("base batch", lambda r: "OOM at it. " + str(r["oom"]["iteration"]) if "oom" in r else "fits"),
        ("peak reserved", lambda r: gib(r.get("peak_reserved"))),
        ("peak allocated", lambda r: gib(r.get("peak_allocated"))),
        ("reserved / allocated", lambda r: fmt(r.get("reserved_over_allocated"), ".3f")),
        ("driver peak used", lambda r: gib(r.get("peak_device_used"))),
        ("median step, s", lambda r: fmt(r.get("median_step_s"), ".3f")),
        (
            "step vs native",
            lambda r: fmt(ratio(r.get("median_step_s"), res.get("native", {}).get("median_step_s")), ".3f"),
        ),
        ("device mallocs / steady step", lambda r: fmt(r.get("device_allocs_per_step"), ".1f")),
        ("maps + creates / steady step", lambda r: fmt(add(r.get("maps_per_step"), r.get("creates_per_step")), ".1f")),
        ("headroom: largest batch", lambda r: headroom_text(r)),
    ]
    width = max(len(r[0]) for r in rows) + 2
    col = 20
    lines.append(" " * width + "".join(n.rjust(col) for n in names))
    for label, f in rows:
        cells = []
        for n in names:
            r = res.get(n, {})
            cells.append(("FAILED" if "failed" in r else "SKIPPED" if "skipped" in r else f(r)).rjust(col))
        lines.append(label.ljust(width) + "".join(cells))
    cap = next((r["headroom"].get("cap_bytes") for r in res.values() if "headroom" in r), None)
    if SIZES[doc["size"]].headroom == "device":
        lines.append(
            f"(headroom: the largest batch whose largest iteration fits the whole device"
            f"{' (' + gib(cap) + ')' if cap else ''}, from base batch {SIZES[doc['size']].batch}: "
            f"doubling, then bisection; + where the probes ran out)"
        )
        lines.append(f"fits under stepalloc where PyTorch runs out of memory? {answer(res)}")
    elif cap:
        lines.append(
            f"(headroom: base batch {SIZES[doc['size']].batch}, the largest iteration, under a cap of "
            f"{gib(cap)} = native peak x {doc['headroom_factor']})"
        )
    lines.append("")
    lines.append("replay of the native run's snapshot (stepalloc-stress) beside the measured peaks:")
    rp = doc.get("replay", {})
    if "runs" in rp:
        src = (rp.get("source") or {}).get("native") or {}
        pairs = [
            ("native (pytorch)", "pytorch", res.get("native_record", {}), src.get("peak_reserved")),
            ("stepalloc", "stepalloc", res.get("stepalloc", {}), None),
        ]
        lines.append(f"{'':22}{'measured':>14}{'predicted':>15}{'predicted/measured':>20}")
        for label, key, measured, _ in pairs:
            m, p = measured.get("peak_reserved"), rp["runs"].get(key, {}).get("peak_reserved")
            lines.append(f"{label:22}{gib(m):>14}{gib(p):>15}{fmt(ratio(p, m), '.3f'):>20}")
        lines.append(
            f"{'floor (peak live)':22}{gib(res.get('native_record', {}).get('peak_allocated')):>14}"
            f"{gib(rp['runs'].get('pytorch', {}).get('floor')):>15}"
        )
        if src.get("peak_reserved") is not None:
            lines.append(
                f"(the snapshot's own segment events give native a peak reserved of {gib(src['peak_reserved'])})"
            )
    else:
        lines.append(f"  replay: {rp.get('skipped') or rp.get('failed')}")
    lines.append("")
    if "prediction" in doc:
        lines += report_lines(doc)
        lines.append("")
    lines.append("targets:")
    for t in doc["targets"]:
        lines.append(f"  {t['status']:7} {t['target']}: {t['detail']}")
    for n in doc["order"]:
        for note in res.get(n, {}).get("notes", []):
            lines.append(f"  note ({n}): {note}")
        for key in ("failed", "error", "skipped"):
            if key in res.get(n, {}):
                lines.append(f"  {key.upper()} ({n}): {res[n][key]}")
    return "\n".join(lines) + "\n"


def ratio(a, b):
    return None if a is None or not b else a / b


def add(a, b):
    return None if a is None and b is None else (a or 0) + (b or 0)


def headroom_text(r: dict) -> str:
    h = r.get("headroom")
    if not h:
        return "-"
    return f"{h['largest_batch']} ({h['scale']:.2f}x){'' if h['exact'] else '+'}"


def prediction_targets(pred: dict) -> list[dict]:
    """One target per compared configuration: predicted peak reserved within GOAL of measured."""
    out = []
    for n, c in (pred.get("configs") or {}).items():
        r = c.get("ratio")
        out.append({
            "target": f"prediction within {GOAL:.0%} of measured peak reserved ({n})",
            "status": "n/a" if r is None else ("MET" if abs(r - 1) <= GOAL else "MISSED"),
            "detail": "no measurement" if r is None else f"predicted/measured {r:.3f}",
        })  # fmt: skip
    return out


def _mib(v) -> str:
    return "-" if v is None else f"{v / MIB:,.0f} MiB"


def report_lines(doc: dict) -> list[str]:
    """The prediction beside the measurement, and the assumptions beside what the device showed."""
    pred = doc.get("prediction") or {}
    lines = ["prediction made on the CPU (this loop recorded under fake tensors by stepalloc.fit, replayed by "
             "stepalloc-stress fit at this device's memory) beside the measured peak reserved:"]  # fmt: skip
    if "configs" not in pred:
        lines.append(f"  no prediction: {pred.get('skipped', 'not made')}")
    else:
        rec = pred["recording"]
        here = next((r for r in doc["configs"].values() if r.get("torch")), {})
        lines.append(
            f"  trace {pred['trace']}: {rec['allocations']:,} allocations in {rec['steps']} steps, recorded "
            f"{rec['recorded']} with torch {rec['torch']}, transformers {rec['transformers']} (measured with torch "
            f"{here.get('torch', '?')}, transformers {here.get('transformers', '?')})"
        )
        memory = "cudaMemGetInfo total" if doc["device"] == "cuda" else "host memory: CPU dry run"
        lines.append(
            f"  replayed at {gib(pred['capacity_bytes'])} ({memory}), {pred['outside_mb']:g} MiB outside PyTorch "
            "(assumed)"
        )
        lines.append(f"  {'':22}{'column':>20}{'steps':>7}{'measured':>13}{'predicted':>13}{'pred/meas':>11}")
        for n, c in pred["configs"].items():
            shown = "-" if c["ratio"] is None else f"{c['ratio']:.3f}"
            oom = "" if c["predicted_fits"] in (True, None) else " (predicted OOM)"
            moom = "" if c["measured_fits"] else " (measured OOM)"
            lines.append(
                f"  {n:22}{c['column']:>20}{c['steps']:>7}{gib(c['measured_peak_reserved']):>13}"
                f"{gib(c['predicted_peak_reserved']):>13}{shown:>11}{oom}{moom}"
            )
        floors = ", ".join(f"{gib(v.get('floor_bytes'))} over {k} steps" for k, v in pred["replays"].items())
        lines.append(
            f"  (live tensors at their peak, predicted: {floors}; MemPool mode is compared with the stepalloc column)"
        )
    lines.append("assumptions of the prediction beside what this device shows:")
    lines += assumption_lines(doc, pred)
    return lines


def assumption_lines(doc: dict, pred: dict) -> list[str]:
    res = doc["configs"]
    lines = []
    cpu = doc["device"] != "cuda"
    out = [(n, r["outside"]) for n, r in res.items() if r.get("outside")]
    if out:
        said = "; ".join(
            f"{n} {_mib(o['memgetinfo_bytes'])} (cudaMemGetInfo used - reserved)"
            + (f", {_mib(o['smi_bytes'])} (nvidia-smi)" if o.get("smi_bytes") is not None else "")
            for n, o in out
        )
        lines.append(f"  memory outside PyTorch: assumed {ASSUMED_OUTSIDE_MB} MiB; measured {said}")
    else:
        why = " (CPU dry run)" if cpu else ""
        lines.append(f"  memory outside PyTorch: assumed {ASSUMED_OUTSIDE_MB} MiB; measured: n/a{why}")
    totals = next((r["device_totals"] for r in res.values() if r.get("device_totals")), None)
    if totals:
        lines.append(
            f"  device memory: cudaMemGetInfo total {_mib(totals.get('memgetinfo_bytes'))}, nvidia-smi total "
            f"{_mib(totals.get('smi_bytes'))} (stepalloc.fit's named cards use nvidia-smi's: h100 81,559 MiB, "
            "h200 143,771 MiB)"
        )
    recorded = (pred.get("recording") or {}).get("attention")
    probe = next((r["attention_probe"] for r in res.values() if r.get("attention_probe")), None)
    counted = next(((n, r["attention"]) for n, r in res.items() if r.get("attention")), None)
    lines.append(
        f"  SDPA backend: recorded {recorded if recorded is not None else '-'}; "
        + (f"this device ({counted[0]}'s loop, {len(res[counted[0]].get('iterations', []))} iterations): {counted[1]}"
           if counted else "this device: not counted (native_expandable did not run)")
    )  # fmt: skip
    for row in probe or []:
        shape = f"B {row['b']}, H {row['h']}/{row['hk']}, S {row['s']}, D {row['d']}"
        cells = []
        for name, f in row["backends"].items():
            if "error" in f:
                cells.append(f"{name}: {f['error'][:60]}")
            else:
                cells.append(f"{name} {_mib(f['measured_bytes'])} measured / {_mib(f['modelled_bytes'])} modelled")
        scratch = (
            "; backward scratch: " + ", ".join(cells) if cells else "; backward scratch: n/a (needs a CUDA device)"
        )
        lines.append(f"  {row['case']} ({shape}): picks {row['picked']}{scratch}")
    if probe is None:
        lines.append("  attention backward scratch: not probed (native_expandable did not run)")
    return lines
