"""What a lab's tests need besides themselves, read from the instructor's source (never run).

    learner_names(source)  every top-level name a solution cell defines: what the trusted
                           test process binds to the learner's kernel (trusted_side.Bridge)
    setup_cells(source)    the ordinary code cells the trusted process runs before the tests
                           that follow them: each cell that imports something and names
                           nothing of the learner's, and each cell that defines a name a test
                           reads (or a cell so chosen reads), a demo that calls the learner's
                           code included; never a cell tagged jupyter-only. A demo that
                           defines nothing the tests read runs in the learner's kernel only,
                           where the notebook shows its output
    cases(code)            a hidden chunk split at its `# case: <label>` lines, for feedback
                           that names the case that failed and nothing else of it
    definitions(code)      what a test cell binds without running anything: re-run after
                           the cell failed half way, so later tests still find its helpers
"""

from __future__ import annotations

import ast
import builtins
import re
import threading

from ..authoring.build import HIDDEN, jupyter_only

CASE = re.compile(r"^# case: *(.+?) *$", re.MULTILINE)


# `course grade --jobs N` grades in threads. CPython 3.11's ast.parse keeps its recursion
# count in state the threads share, so two parses at once can fail with "SystemError: AST
# constructor recursion depth mismatch" (cpython gh-106905): one parse at a time.
_PARSE_LOCK = threading.Lock()


def _parse(source: str) -> ast.Module:
    with _PARSE_LOCK:
        return ast.parse(source)


def meta(cell) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {}) or {}


def _names(source: str) -> tuple[set[str], set[str]]:
    """(names the cell binds anywhere, names it reads that it never binds)."""
    try:
        tree = _parse(HIDDEN.sub(lambda m: m.group(1), source))
    except SyntaxError:
        return set(), set()
    bound, read = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return bound, read - bound - set(dir(builtins))


def _top_level(source: str) -> set[str]:
    """The names a cell defines at its top level (def, class, assignment, import)."""
    try:
        tree = _parse(source)
    except SyntaxError:
        return set()
    found = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            found.update((a.asname or a.name).split(".")[0] for a in node.names)
    return found


def learner_names(source_nb) -> list[str]:
    return sorted(set().union(*[_top_level(c.source) for c in source_nb.cells
                                if c.cell_type == "code" and meta(c).get("solution")]))


def _imports(source: str) -> bool:
    try:
        tree = _parse(source)
    except SyntaxError:
        return False
    return any(isinstance(node, (ast.Import, ast.ImportFrom)) for node in ast.walk(tree))


def setup_cells(source_nb) -> list[int]:
    """Indices in `source_nb.cells` of the ordinary cells the trusted process runs: the cells
    that import (their side effects, such as `harness.triton_setup()`, go with them) and
    name nothing of the learner's, and then every cell that defines a name a test or a chosen
    cell reads (the latest such cell above the reader)."""
    learner = set(learner_names(source_nb))
    code = [(i, c) for i, c in enumerate(source_nb.cells) if c.cell_type == "code"]
    kinds = {i: "solution" if meta(c).get("solution") else "test" if meta(c).get("grade")
             else "jupyter-only" if jupyter_only(c) else "code" for i, c in code}
    names = {i: _names(c.source) for i, c in code}
    chosen = {i for i, c in code if kinds[i] == "code" and not names[i][1] & learner
              and _imports(c.source)}
    readers = [i for i, _ in code if kinds[i] == "test"] + sorted(chosen)
    while readers:                  # cells that define what a test (or a chosen cell) reads
        i = readers.pop()
        for name in names[i][1] - learner:
            definer = next((j for j, _ in reversed(code) if j < i and name in names[j][0]
                            and kinds[j] != "solution"), None)
            if definer is not None and kinds[definer] == "code" and definer not in chosen:
                chosen.add(definer)
                readers.append(definer)
    return sorted(chosen)


def cases(code: str) -> list[tuple[str, str]]:
    """(label, code) of each case of a hidden chunk; code before the first label is
    labelled "hidden tests"."""
    marks = list(CASE.finditer(code))
    parts = [("hidden tests", code[:marks[0].start()] if marks else code)]
    for k, m in enumerate(marks):
        end = marks[k + 1].start() if k + 1 < len(marks) else len(code)
        parts.append((m.group(1), code[m.start():end]))
    return [(label, body) for label, body in parts if body.strip()]


def definitions(code: str) -> str:
    """The top-level imports, functions, classes and names bound to literals of a test
    cell (hidden chunks included): binding them runs no learner code, so they are re-run
    after the cell failed half way (a crash in the learner's kernel, a failed assertion)
    and the tests below that use the cell's helpers still run."""
    try:
        tree = _parse(HIDDEN.sub(lambda m: m.group(1), code))
    except SyntaxError:
        return ""
    keep = []
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef,
                             ast.AsyncFunctionDef, ast.ClassDef)):
            keep.append(node)
        elif isinstance(node, ast.Assign):
            try:
                ast.literal_eval(node.value)
            except ValueError:
                continue
            keep.append(node)
    return "\n".join(ast.unparse(node) for node in keep)
