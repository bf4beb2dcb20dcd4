#!/usr/bin/env python3
"""One summary of a GPU run (gpu/run_all.sh): every check's pass / fail / skip (validate.sh's
and run_all.sh's own), the end-to-end comparisons (the 7 B one, OUT/e2e_7b, and its answer to
whether the loop fits under stepalloc where PyTorch runs out of memory; then the 1.4 B one,
OUT/e2e, with the replay's predicted peaks), the sleep/wake figures (gpu/sleep_check.py's
checks/sleep.json: the cycle, the 7 B colocated loop, the switch's component costs), as
OUT/summary.json and OUT/summary.txt. Prints the text.

Usage: summarize.py OUT [--bundle BUNDLE] [--seconds S]
Exit status: 0 when no check failed and a comparison ran (one the time budget skipped is a
SKIP), 1 otherwise, 2 on bad input.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from pathlib import Path

LINE = re.compile(r"^RESULT (PASS|FAIL|SKIP) (\S+) ?(.*)$")


def results(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        m = LINE.match(line)
        if m:
            out.append({"status": m[1], "name": m[2], "detail": m[3][:300]})
    return out


def state(e2e: dict | None) -> str:
    if e2e is None:
        return "not run"
    return "FAILED" if e2e.get("failed") else "ran"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--bundle", type=Path)
    ap.add_argument("--seconds", type=int)
    a = ap.parse_args()
    if not a.out.is_dir():
        print(f"error: output folder {a.out} does not exist", file=sys.stderr)
        return 2
    checks = results(a.out / "checks" / "results")
    validate = results(a.out / "validate" / "summary")
    if not validate:
        validate = [{"status": "FAIL", "name": "validate", "detail": "validate.sh left no summary (see validate.log)"}]
    answers = []
    vs = a.out / "validate" / "summary"
    if vs.is_file():
        answers = [
            line[len("ANSWER ") :] for line in vs.read_text(errors="replace").splitlines() if line.startswith("ANSWER ")
        ]
    e2e = None
    e2e_path = a.out / "e2e" / "e2e.json"
    if e2e_path.is_file():
        e2e = json.loads(e2e_path.read_text())
    e2e_7b = None
    e2e_7b_path = a.out / "e2e_7b" / "e2e.json"
    if e2e_7b_path.is_file():
        e2e_7b = json.loads(e2e_7b_path.read_text())
    sleep = None
    sleep_path = a.out / "checks" / "sleep.json"
    if sleep_path.is_file():
        sleep = json.loads(sleep_path.read_text())
    source = None
    if a.bundle and (a.bundle / "MANIFEST.json").is_file():
        source = json.loads((a.bundle / "MANIFEST.json").read_text()).get("source")
    every = validate + checks
    counts = {k: sum(1 for c in every if c["status"] == k) for k in ("PASS", "FAIL", "SKIP")}
    ran = [c for c in (e2e_7b, e2e) if c is not None and not c.get("failed")]
    ok = counts["FAIL"] == 0 and bool(ran)
    doc = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "source": source,
        "seconds": a.seconds,
        "ok": ok,
        "counts": counts,
        "checks": every,
        "answers": answers,
        "sleep": sleep,
        "e2e_7b": e2e_7b,
        "e2e": e2e,
    }
    (a.out / "summary.json").write_text(json.dumps(doc, indent=1) + "\n")
    lines = [
        f"stepalloc GPU run, {doc['date']}"
        + (f", commit {source['commit'][:12]}" if source and source.get("commit") else "")
        + (f", {a.seconds} s" if a.seconds is not None else "")
    ]
    lines.append("")
    lines.append("checks:")
    lines += [f"  {c['status']} {c['name']} {c['detail']}".rstrip() for c in every]
    if answers:
        lines.append("")
        lines.append("answers to open questions:")
        lines += [f"  * {x}" for x in answers]
    lines.append("")
    e2e_7b_txt = a.out / "e2e_7b" / "e2e.txt"
    lines.append(
        e2e_7b_txt.read_text().rstrip()
        if e2e_7b_txt.is_file()
        else "end-to-end comparison at 7 B: no result (see e2e_7b.log)"
    )
    lines.append("")
    sleep_txt = a.out / "checks" / "sleep.txt"
    lines.append(
        sleep_txt.read_text().rstrip()
        if sleep_txt.is_file()
        else "sleep and wake: no result (see checks/sleep_check.log)"
    )
    lines.append("")
    e2e_txt = a.out / "e2e" / "e2e.txt"
    lines.append(
        e2e_txt.read_text().rstrip() if e2e_txt.is_file() else "end-to-end comparison: no result (see e2e.log)"
    )
    lines.append("")
    lines.append(
        f"stepalloc GPU run: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped; "
        f"comparisons: 7 B {state(e2e_7b)}, 1.4 B {state(e2e)}; "
        f"{'OK' if ok else 'NOT OK'} (summary.json, summary.txt in {a.out})"
    )
    text = "\n".join(lines) + "\n"
    (a.out / "summary.txt").write_text(text)
    print(text, end="")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
