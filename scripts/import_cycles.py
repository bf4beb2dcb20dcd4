#!/usr/bin/env python3
"""Import circles between modules, read from the code's own paths: the Rust crates under src/
and stress/src/ (`use crate::…`, `super::…`, `self::…` and paths through a child module, in
`use` lines and in code) and the Python package python_shim/stepalloc with its subpackages
(`from .x import`, `from . import x`, `from .. import x`, `import stepalloc.x`, also inside
functions).

A module is a file (or an inline `mod name { … }`). An edge A -> B says A names something in
B. A submodule is part of its parent: a module may name its ancestors' items without an edge,
and every parent is taken to use its submodules (so a circle through a submodule is its
parent's). `#[cfg(test)]` modules are left out: a unit test may build anything. The Python
package's __init__ is a module like the others.

Usage: import_cycles.py [--graph]   (--graph: also print each module with the modules it uses,
one line a module, `-` for none)
Prints each circle (a strongly connected set of modules, with one cycle through it) and exits
1 if there is any, else prints the module counts and exits 0.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUST_CRATES = {"stepalloc": ROOT / "src", "stepalloc_stress": ROOT / "stress" / "src"}
PY_PACKAGE = ROOT / "python_shim" / "stepalloc"

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"


def strip_rust(text: str) -> str:
    """`text` with comments, string and char literals blanked (same length, newlines kept)."""
    out = list(text)
    i, n = 0, len(text)

    def blank(a: int, b: int) -> None:
        for k in range(a, min(b, n)):
            if out[k] != "\n":
                out[k] = " "

    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            blank(i, j)
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            blank(i, j)
            i = j
        elif (m := re.match(r'b?r(#*)"', text[i : i + 260])) and (i == 0 or not re.match(r"\w", text[i - 1])):
            end = '"' + m.group(1)
            j = text.find(end, i + m.end())
            j = n if j < 0 else j + len(end)
            blank(i, j)
            i = j
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            blank(i, j + 1)
            i = j + 1
        elif c == "'":
            # A char literal ('x', '\n', '\u{..}') or a lifetime ('a).
            if i + 1 < n and text[i + 1] == "\\":
                j = text.find("'", i + 2)
                blank(i, j + 1)
                i = j + 1
            elif i + 2 < n and text[i + 2] == "'":
                blank(i, i + 3)
                i += 3
            else:
                i += 1
        else:
            i += 1
    return "".join(out)


def matching_brace(text: str, open_at: int) -> int:
    depth = 0
    for k in range(open_at, len(text)):
        if text[k] == "{":
            depth += 1
        elif text[k] == "}":
            depth -= 1
            if depth == 0:
                return k
    return len(text) - 1


def split_inline_modules(text: str, path: tuple[str, ...]) -> list[tuple[tuple[str, ...], str]]:
    """The file's own text and each inline module's, with their module paths; cfg(test)
    modules dropped."""
    pieces: list[tuple[tuple[str, ...], str]] = []
    own: list[str] = []
    pos = 0
    for m in re.finditer(r"(#\[cfg\(test\)\]\s*)?(?:pub(?:\([^)]*\))?\s+)?mod\s+(" + IDENT + r")\s*\{", text):
        if m.start() < pos:
            continue  # inside a module already taken
        close = matching_brace(text, m.end() - 1)
        own.append(text[pos : m.start()])
        if not m.group(1):
            pieces.extend(split_inline_modules(text[m.end() : close], path + (m.group(2),)))
        pos = close + 1
    own.append(text[pos:])
    return [(path, "".join(own))] + pieces


def rust_modules(crate: str, src: Path) -> dict[tuple[str, ...], str]:
    """Every module of the library crate rooted at src/lib.rs: its path -> its code. A file
    declared `#[cfg(test)] mod name;` (a unit test in a file of its own) is left out with its
    submodules, like an inline cfg(test) module."""
    files: list[tuple[tuple[str, ...], str]] = []
    test_only: set[tuple[str, ...]] = set()
    for f in sorted(src.rglob("*.rs")):
        rel = f.relative_to(src).with_suffix("").parts
        if rel[0] in ("main", "bin"):
            continue  # binaries are crates of their own
        if rel[-1] == "mod":
            rel = rel[:-1]
        if rel == ("lib",):
            rel = ()
        code = strip_rust(f.read_text())
        here = (crate,) + rel
        for m in re.finditer(r"#\[cfg\(test\)\]\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(" + IDENT + r")\s*;", code):
            test_only.add(here + (m.group(1),))
        files.append((here, code))
    modules: dict[tuple[str, ...], str] = {}
    for here, code in files:
        if any(is_ancestor(t, here) for t in test_only):
            continue
        for path, piece in split_inline_modules(code, here):
            modules[path] = modules.get(path, "") + piece
    return modules


def use_paths(code: str) -> list[list[str]]:
    """Every path the code names through `crate`, `super`, `self` or a bare first segment, with
    `use` trees expanded (`use a::{b, c::d}` -> a::b, a::c::d)."""
    paths: list[list[str]] = []

    def expand(prefix: list[str], tree: str) -> None:
        tree = tree.strip()
        if not tree:
            return
        depth, parts, start = 0, [], 0
        for k, ch in enumerate(tree):
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
            elif ch == "," and depth == 0:
                parts.append(tree[start:k])
                start = k + 1
        parts.append(tree[start:])
        if len(parts) > 1:
            for p in parts:
                expand(prefix, p)
            return
        t = re.sub(r"\s+as\s+" + IDENT + r"\s*$", "", tree)
        if "{" in t:
            head, rest = t.split("{", 1)
            segs = [s for s in head.strip().rstrip(":").split("::") if s]
            expand(prefix + segs, rest.rsplit("}", 1)[0])
        else:
            paths.append(prefix + [s.strip() for s in t.split("::") if s.strip()])

    for m in re.finditer(r"\buse\s+([^;]*);", code):
        expand([], m.group(1).lstrip(":"))
    rest = re.sub(r"\buse\s+[^;]*;", " ", code)
    for m in re.finditer(r"(?<![\w:])(" + IDENT + r"(?:\s*::\s*" + IDENT + r")+)", rest):
        paths.append([s.strip() for s in m.group(1).split("::")])
    return paths


def resolve_rust(
    path: list[str], here: tuple[str, ...], modules: dict[tuple[str, ...], str]
) -> tuple[str, ...] | None:
    """The module a path names (its longest prefix that is a module), or None (another crate,
    a type's associated item, ...)."""
    if not path:
        return None
    if path[0] == "crate":
        base, rest = (here[0],), path[1:]
    elif path[0] in ("super", "self"):
        base, rest = here, path
        while rest and rest[0] in ("super", "self"):
            if rest[0] == "super":
                base = base[:-1]
            rest = rest[1:]
        if len(base) < 1:
            return None
    elif here + (path[0],) in modules:
        base, rest = here, path  # a child module, named from its parent
    else:
        return None
    best = base if base in modules else None
    for k in range(1, len(rest) + 1):
        cand = base + tuple(rest[:k])
        if cand in modules:
            best = cand
        else:
            break
    return best


def is_ancestor(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    """Whether `a` is `b` or contains it."""
    return b[: len(a)] == a


def rust_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for crate, src in RUST_CRATES.items():
        modules = rust_modules(crate, src)
        for here, code in modules.items():
            edges = graph.setdefault("::".join(here), set())
            if len(here) > 1:  # a parent uses its submodules
                graph.setdefault("::".join(here[:-1]), set()).add("::".join(here))
            for p in use_paths(code):
                to = resolve_rust(p, here, modules)
                if to is not None and not is_ancestor(to, here):
                    edges.add("::".join(to))
    return graph


def python_graph() -> dict[str, set[str]]:
    """The package's modules by dotted name (a subpackage's __init__ is the subpackage: `stepalloc.fit`)
    and the modules each one imports, relative imports resolved against its package."""
    pkg = PY_PACKAGE.name
    files: dict[str, Path] = {}
    for f in sorted(PY_PACKAGE.rglob("*.py")):
        parts = [pkg, *f.relative_to(PY_PACKAGE).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = f

    def deepest(name: str) -> str:
        """The longest prefix of `name` that is a module of the package."""
        parts = name.split(".")
        while parts and ".".join(parts) not in files:
            parts.pop()
        return ".".join(parts)

    graph: dict[str, set[str]] = {}
    for here, f in files.items():
        package = here if f.name == "__init__.py" else here.rpartition(".")[0]
        edges = graph.setdefault(here, set())
        for node in ast.walk(ast.parse(f.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                if node.level > 0:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                elif (node.module or "").split(".")[0] == pkg:
                    source = node.module or pkg
                else:
                    continue
                for a in node.names:  # from P import a: the submodule P.a, or P's own name
                    targets.append(deepest(f"{source}.{a.name}"))
            elif isinstance(node, ast.Import):
                targets += [deepest(a.name) for a in node.names if a.name.split(".")[0] == pkg]
            edges.update(t for t in targets if t and t != here)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected sets of more than one module (Tarjan), each as one cycle through it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(10000)

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(one_cycle(graph, sorted(comp)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def one_cycle(graph: dict[str, set[str]], comp: list[str]) -> list[str]:
    """A shortest cycle through the first module of a strongly connected set."""
    members, start = set(comp), comp[0]
    prev: dict[str, str] = {}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph.get(v, ())):
            if w not in members:
                continue
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(prev[path[-1]])
                return list(reversed(path)) + [start]
            if w not in prev:
                prev[w] = v
                queue.append(w)
    return comp


def main() -> int:
    show = "--graph" in sys.argv[1:]
    bad = 0
    for label, graph in (("Rust", rust_graph()), ("Python", python_graph())):
        if show:  # each module and the modules it uses, one line each
            for v in sorted(graph):
                print(f"{v}: {', '.join(sorted(graph[v])) or '-'}")
        found = cycles(graph)
        for c in found:
            print(f"import circle ({label}): {' -> '.join(c)}")
        bad += len(found)
        edges = sum(len(e) for e in graph.values())
        print(f"{label}: {len(graph)} modules, {edges} edges, {len(found)} circles")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
