#!/usr/bin/env python3
"""The documents describe the project as it is: README.md, docs/*.md and python_shim/README.md
must not name our own issue numbers or tell the story of how the code got here, must stay
within their line limits, and their relative links and anchors must lead somewhere.

What fails, each reported as PATH:LINE: what, and why:
  * an issue or item number of ours: "issue 34", "#34", "item 4". Citations of other projects
    stay: a number preceded (within three words) by a project's name or "owner/repo", as in
    "pytorch #159674", "vLLM PR #43020", "pytorch/pytorch#1234" (UPSTREAM lists the names);
  * chronicle words (CHRONICLE): "this round", "previously", "no longer", "now ... instead of",
    "before the change", "since 2026-12-04", "commit 5d347e7", "(was 62.3%)", ... A document
    gives today's figure with its date, and a table of what was tried and not kept; the story of
    how a figure was reached belongs in commit messages;
  * a file over its line limit (LIMITS);
  * a relative link to a file that does not exist, or to an anchor (#heading) that no heading
    or <a id> of the target has (GitHub's rule: lower case, punctuation dropped, spaces to -).

Usage: scripts/doc_check.py [--root DIR]   check the documents under DIR (default: the repository)
       scripts/doc_check.py --self-test    check the checker on planted violations and on prose
                                            that must pass
Exit status: 0 clean, 1 problems found (listed on stdout).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

# Line limits of the documents that have one (paths relative to the repository root).
LIMITS = {"README.md": 300, "docs/performance.md": 450, "python_shim/README.md": 450}

# Names that make a following "#N" or "issue N" a citation of another project, not ours.
UPSTREAM = (
    "pytorch", "torch", "vllm", "rmm", "nccl", "cuda", "transformers", "accelerate", "lightning",
    "torch_memory_saver", "sglang", "verl", "openrlhf", "slime", "triton", "prometheus",
    "grafana", "hyper", "tokio", "cudarc", "criterion", "cargo", "rust", "python", "cpython",
)

OUR_NUMBER = re.compile(r"(?i)\bissues?\s+#?\d+\b|(?<![\w/&])#\d+\b|\bitems?\s+\d+\b")

# (pattern, what it is): phrases that tell what the code was rather than what it is.
CHRONICLE = [
    (r"\b(this|last|next|previous|earlier|later|second|third|fourth|fifth)\s+rounds?\b", "a round of work"),
    (r"\bin a round\b|\brounds?\s+\d+\b", "a round of work"),
    (r"\b(second|third|fourth|fifth|sixth)\s+(adversarial\s+)?pass\b", "an ordinal pass of work"),
    (r"\bpreviously\b|\bno longer\b|\banymore\b", "what the code was"),
    (r"\b(it|we|they|this|that|which|stepalloc)\s+used to\b", "what the code was"),
    (r"\bnow\b[^.;:|]{0,100}?\binstead of\b", "'now ... instead of' (what changed)"),
    (r"\b(before|after) (the|this|that) (changes?|fix|fixes)\b|\bthe code before\b", "a change's before and after"),
    (r"\bsince (commit\b|\d{4}-\d\d-\d\d\b)|\bcommit [0-9a-f]{7,40}\b", "a commit or a date as history"),
    (r"\(was\b", "a superseded figure '(was ...)'"),
]
CHRONICLE_RE = [(re.compile(p, re.IGNORECASE), what) for p, what in CHRONICLE]

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")


def is_upstream(line: str, start: int) -> bool:
    """Whether the number at `start` cites another project: one of the three words before it
    (or the text glued to it, as in pytorch/pytorch#1234) names one."""
    before = line[:start]
    if re.search(r"[\w.-]+/[\w.-]+$", before):
        return True
    words = re.findall(r"[\w.-]+", before)[-3:]
    return any(w.lower().strip(".-") in UPSTREAM for w in words)


def prose(lines: list[str]) -> list[tuple[int, str, bool]]:
    """(line number, text, inside a code block) for every line."""
    out, fenced = [], False
    for n, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            out.append((n, line, True))
            continue
        out.append((n, line, fenced))
    return out


def wording_problems(text: str) -> list[tuple[int, str]]:
    """Issue numbers of ours and chronicle words, by line."""
    problems = []
    for n, line, _ in prose(text.splitlines()):
        for m in OUR_NUMBER.finditer(line):
            if not is_upstream(line, m.start()):
                problems.append((n, f"names an issue or item number of ours: {m.group(0)!r}"))
        for pattern, what in CHRONICLE_RE:
            for m in pattern.finditer(line):
                problems.append((n, f"chronicle words, {what}: {m.group(0)!r}"))
    return problems


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: links and tags reduced to their text, lower case,
    everything but letters, digits, _, - and spaces dropped, spaces turned into -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor a document offers: its headings' (repeats numbered -1, -2, ...) and its
    <a id="..."> tags."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, line, code in prose(text.splitlines()):
        found.update(HTML_ANCHOR.findall(line))
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m and not code:
            base = slug(m.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def link_problems(path: Path, text: str, root: Path) -> list[tuple[int, str]]:
    """Relative links whose file or anchor does not exist."""
    problems = []
    for n, line, code in prose(text.splitlines()):
        if code:
            continue
        line = re.sub(r"`[^`]*`", "", line)  # a link inside a code span is not a link
        for m in LINK.finditer(line):
            target = m.group(1)
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            if not dest.exists():
                problems.append((n, f"link to a missing file: {target}"))
                continue
            if anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
                problems.append((n, f"link to a missing anchor: {target}"))
            try:
                dest.relative_to(root)
            except ValueError:
                problems.append((n, f"link leaves the repository: {target}"))
    return problems


def documents(root: Path) -> list[Path]:
    docs = [root / "README.md", *sorted((root / "docs").glob("*.md")), root / "python_shim" / "README.md"]
    return [d for d in docs if d.exists()]


def check(root: Path) -> list[str]:
    out = []
    for path in documents(root):
        rel = path.relative_to(root).as_posix()
        text = path.read_text()
        limit = LIMITS.get(rel)
        count = len(text.splitlines())
        if limit is not None and count > limit:
            out.append(
                f"{rel}: {count} lines, over its limit of {limit} (scripts/doc_check.py LIMITS): "
                "keep today's method and figures, drop the story of how they were reached"
            )
        for n, what in wording_problems(text) + link_problems(path, text, root):
            out.append(f"{rel}:{n}: {what}")
    return out


def self_test() -> None:
    """Planted violations are found; ordinary prose and upstream citations pass."""
    must_fail = [
        "issue 34 item 4 asked for it",
        "as #34 said",
        "See issue #12.",
        "The backup per allocation (issue 32) is",
        "measured in this round",
        "last round's figure",
        "Fourth adversarial pass (2026-12-06)",
        "the heap previously scanned every block",
        "the flag is no longer needed",
        "stepalloc used to scan every free block",
        "the row now means the largest request instead of the largest block",
        "before the change it took 336.7 ms",
        "pass (since 2026-12-06)",
        "commit 5d347e7 of the library",
        "**0.2%** (was 62.3%)",
    ]
    must_pass = [
        "the other way round",
        "round request sizes up to one of N divisions",
        "400 random rounds of allocate / free",
        "frees nothing while a pool is in use: vLLM PR #49151",
        "pytorch #159674 and pytorch/pytorch#1234",
        "PyTorch issue 12345 describes it",
        "`STEPALLOC_VICTIM_ROUNDS=9 scripts/torch_victim.sh`",
        "the memory used to back the tensors is pinned",
        "a key is used to select the pool",
        "now the pause is refused",
        "measured 2026-12-06 on a 2-core x86-64 machine",
        "[link](#anchor) # a comment",
    ]
    for text in must_fail:
        assert wording_problems(text), f"self-test: not flagged: {text!r}"
    for text in must_pass:
        assert not wording_problems(text), f"self-test: flagged: {text!r}: {wording_problems(text)}"
    assert slug("Sleep and wake: the copy path") == "sleep-and-wake-the-copy-path"
    assert slug("Against PyTorch's own allocator") == "against-pytorchs-own-allocator"
    assert slug("Which settings for my trace: `advise`") == "which-settings-for-my-trace-advise"
    assert slug("torch_memory_saver's own tests, side by side") == "torch_memory_savers-own-tests-side-by-side"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n<a id=\"x\"></a>\n") == {"a", "a-1", "x"}
    here = Path(__file__).resolve()
    root = here.parent.parent
    fake = root / "docs" / "planted.md"
    broken = "[ok](../README.md) [gone](missing.md) [no anchor](../README.md#no-such-heading)\n"
    found = [what for _, what in link_problems(fake, broken, root)]
    assert found == [
        "link to a missing file: missing.md",
        "link to a missing anchor: ../README.md#no-such-heading",
    ], found
    print("doc_check self-test: ok")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    ap.add_argument("--self-test", action="store_true")
    args = ap.parse_args()
    if args.self_test:
        self_test()
        return 0
    problems = check(args.root.resolve())
    for p in problems:
        print(p)
    if problems:
        print(f"doc_check: {len(problems)} problem(s); scripts/doc_check.py says what each rule is for")
        return 1
    print(f"doc_check: {len(documents(args.root.resolve()))} documents clean")
    return 0


if __name__ == "__main__":
    sys.exit(main())
