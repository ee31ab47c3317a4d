"""What `make check` saves of a notebook: its definitions, each with everything it needs.

From every code cell that is not a test, in notebook order: the top-level imports, the
public functions and classes, the UPPER_CASE constants whose values need nothing but what is
saved before them, and then whatever those need, whatever its name (the closure: a helper
`_scale_blocks`, a table `_codes = torch.tensor(...)`, a class a function builds). A name a
saved definition needs that the notebook only sets at run time (a loop variable, a tensor a
demo cell computed from data) cannot be saved: `Definitions.incomplete` names each saved
function or class that needs one, and what it needs, so that `make check` can say so and
`use("mine")` keeps such a piece on the reference.

    saved = definitions(nb)
    saved.source          # the module's text
    saved.names           # every name it defines
    saved.incomplete      # {name defined: [names it needs that were not saved]}
"""

from __future__ import annotations

import ast
import builtins
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import nbformat

Definition = ast.Import | ast.ImportFrom | ast.FunctionDef | ast.ClassDef | ast.Assign \
    | ast.AnnAssign


@dataclass
class Definitions:
    source: str
    names: list[str] = field(default_factory=list)
    incomplete: dict[str, list[str]] = field(default_factory=dict)


def is_test(cell) -> bool:
    return bool(cell.metadata.get("nbgrader", {}).get("grade")) and not \
        cell.metadata.get("nbgrader", {}).get("solution")


def _targets(node: ast.stmt) -> list[str] | None:
    """The names an assignment of plain names binds (`A = ...`, `A, B = ...`), or None."""
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    names = []
    for t in targets:
        parts = t.elts if isinstance(t, ast.Tuple) else [t]
        if not all(isinstance(p, ast.Name) for p in parts):
            return None
        names += [p.id for p in parts]
    return names


def _constant(names: list[str]) -> bool:
    return all(len(n) > 1 and n.isupper() and not n.startswith("_") for n in names)


def _bound(node: ast.stmt) -> list[str]:
    if isinstance(node, ast.Import | ast.ImportFrom):
        return [(a.asname or a.name).split(".")[0] for a in node.names]
    if isinstance(node, ast.Assign | ast.AnnAssign):
        return _targets(node) or []
    return [node.name]


def free_names(node: ast.AST) -> set[str]:
    """The names `node` reads that it does not bind itself (its parameters, its locals, the
    functions, classes and imports inside it) and that are not builtins: the module globals
    it needs. A name both assigned and read inside counts as its own."""
    loaded, bound = set(), set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            (loaded if isinstance(n.ctx, ast.Load) else bound).add(n.id)
        elif isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            a = n.args
            bound |= {x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]
                      if x is not None}
        elif isinstance(n, ast.Import | ast.ImportFrom):
            bound |= set(_bound(n))
        elif isinstance(n, ast.ExceptHandler) and n.name:
            bound.add(n.name)
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and n is not node:
            bound.add(n.name)
    return loaded - bound - set(dir(builtins))


def _candidates(nb) -> list[tuple[ast.stmt, str]]:
    """(statement, its source lines) of every top-level import, def, class and assignment of
    plain names in the notebook's non-test code cells, in order. A cell that does not parse
    is skipped (its test failed anyway)."""
    out = []
    for cell in nb.cells:
        if cell.cell_type != "code" or is_test(cell):
            continue
        try:
            tree = ast.parse(cell.source)
        except SyntaxError:
            continue
        lines = cell.source.splitlines()
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module == "__future__":
                continue
            if isinstance(node, ast.Assign | ast.AnnAssign) and (
                    node.value is None or _targets(node) is None):
                continue
            if isinstance(node, Definition):
                first = min([node.lineno] + [d.lineno for d in
                                             getattr(node, "decorator_list", [])])  # @triton.jit
                out.append((node, "\n".join(lines[first - 1:node.end_lineno])))
    return out


def _needed(candidates: list[tuple[ast.stmt, str]]) -> set[str]:
    """The names to save: the public functions and classes, the UPPER_CASE constants, and
    every name they need that the notebook defines (to a fixed point)."""
    defined: dict[str, list[ast.stmt]] = {}
    for node, _ in candidates:
        for name in _bound(node):
            defined.setdefault(name, []).append(node)
    needed = {name for node, _ in candidates for name in _bound(node)
              if isinstance(node, ast.FunctionDef | ast.ClassDef) and not name.startswith("_")
              or isinstance(node, ast.Assign | ast.AnnAssign) and _constant(_bound(node))}
    todo = list(needed)
    while todo:
        for node in defined.get(todo.pop(), []):
            if isinstance(node, ast.Import | ast.ImportFrom) or \
                    isinstance(node, ast.Assign | ast.AnnAssign) and _constant(_bound(node)):
                continue            # a constant is saved when what it reads is, not its reads
            for name in free_names(node) - needed:
                if name in defined:
                    needed.add(name)
                    todo.append(name)
    return needed


def definitions(nb: nbformat.NotebookNode) -> Definitions:
    """The saved module of a notebook (see the module docstring). Every import is kept. An
    UPPER_CASE constant is kept when its value reads only what is saved before it; any other
    assignment a definition needs, when its value reads only imports, builtins and values
    saved before it (never a function of the notebook's: loading runs no learner code but
    what the learner named a constant)."""
    candidates = _candidates(nb)
    needed = _needed(candidates)
    known, plain, kept, reads = set(dir(builtins)), set(dir(builtins)), [], {}
    for node, text in candidates:
        names = _bound(node)
        if not isinstance(node, ast.Import | ast.ImportFrom):
            if not set(names) & needed:
                continue
            if isinstance(node, ast.Assign | ast.AnnAssign) and \
                    not free_names(node) <= (known if _constant(names) else plain):
                continue
            reads.update({name: free_names(node) for name in names})
        if not isinstance(node, ast.FunctionDef | ast.ClassDef):
            plain.update(names)
        known.update(names)
        kept.append((isinstance(node, ast.Import | ast.ImportFrom), text))
    # imports one per line; two blank lines around everything else
    source = "".join(("" if i == 0 else "\n" if imp and kept[i - 1][0] else "\n\n\n") + text
                     for i, (imp, text) in enumerate(kept)) + "\n"
    missing = {name: sorted(r - known) for name, r in reads.items() if r - known}
    changed = True
    while changed:                  # a function calling an incomplete one is incomplete too
        changed = False
        for name, r in reads.items():
            if name not in missing and (lacking := sorted(r & set(missing))):
                missing[name], changed = lacking, True
    return Definitions(source, sorted(known - set(dir(builtins))), missing)
