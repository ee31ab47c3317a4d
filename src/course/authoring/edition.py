"""The student edition: the public repository without the bodies of what the labs ask the
learners to write (labs/INSTRUCTORS.md, "Hidden tests"; docs/ARCHITECTURE.md, Student edition).

    python -m course edition OUT [--through NN]

    OUT/  STUDENT_PATHS copied from the course (never solutions/, build/, .git, caches), and
          EDITION_FILE: which lab the references are released through, and what is stubbed
    OUT/src/: each object of a lab not released rewritten with `ast` where it is defined:
          a function keeps its decorators, signature and docstring, its body raises
          "Lab NN asks you to write this"; a class keeps its name, bases, docstring, data and
          its methods' signatures (each raising), and constructing it raises; a Triton kernel
          becomes an `_Unreleased` object that raises when launched (`kernel[grid](...)`) or
          called. A module constant that a stubbed function computes at import is written as
          its value. Every rewritten module maps what it stubs to the lab in `__unreleased__`.

Who writes an object: the first lab whose REFERENCE table lists it (not as GIVEN), unless the
package's WRITTEN table names a later lab; the other labs list it to switch it off. The
edition released through lab T stubs what the labs after T write. The one a lab G is graded
in (`grading_src`) is released through the lab before G and stubs, besides, every reference G
switches off but its GIVEN names, so that no import in the learner's kernel reaches one.
"""

from __future__ import annotations

import ast
import importlib
import json
import pprint
import shutil
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import torch

from labkit.errors import InputError

from ..notebook.harness import REFERENCE_PACKAGES
from .build import lab_names

# What the student repository holds (labs/INSTRUCTORS.md), and what is never copied into it.
STUDENT_PATHS = ("labs", "src", "experiments", "scripts", ".devcontainer", "Makefile",
                 "pyproject.toml", "uv.lock", "constraints.txt", "README.md", ".gitignore")
SKIPPED = ("__pycache__", "*.pyc", "*.egg-info", ".ipynb_checkpoints", ".run-*")
EDITION_FILE = ".course-edition.json"     # at the top of an edition: what may be written over
KERNEL_DECORATORS = ("jit", "autotune", "heuristics")     # triton.jit and its wrappers
UNRELEASED = '''class _Unreleased:
    """A Triton kernel of the student edition: launching or calling it raises."""

    def __init__(self, message):
        self.message = message

    def __getitem__(self, grid):
        return self

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(self.message)


'''


def _tables() -> Iterator[tuple[dict, dict, dict]]:
    """(REFERENCE, GIVEN, WRITTEN) of each package that names what the labs rebuild."""
    for package in REFERENCE_PACKAGES:
        module = importlib.import_module(package)
        yield (getattr(module, "REFERENCE", {}), getattr(module, "GIVEN", {}),
               getattr(module, "WRITTEN", {}))


def writers() -> dict[str, str]:
    """{dotted path: the lab that writes it} of every object a REFERENCE table names."""
    listed: dict[str, list[str]] = {}
    written: dict[str, str] = {}
    for reference, given, written_in in _tables():
        for lab, names in reference.items():
            for name, path in names.items():
                if name not in given.get(lab, ()):
                    listed.setdefault(path, []).append(lab)
                if name in written_in:
                    written[path] = written_in[name]
    return {path: written.get(path, min(labs)) for path, labs in sorted(listed.items())}


def stubbed(through: str | None, graded: str | None = None) -> dict[str, str]:
    """{dotted path: the lab its stub names}: what the labs after `through` write (None:
    every lab's), and with `graded`, every reference that lab switches off but its GIVEN."""
    out = {path: lab for path, lab in writers().items() if through is None or lab > through}
    for reference, given, _ in _tables():
        for name, path in reference.get(graded, {}).items():
            if name not in given.get(graded, ()):
                out.setdefault(path, graded)
    return dict(sorted(out.items()))


def lab_called(text: str, labs: list[str]) -> str:
    """The lab named by `text`, its full name or its number ("03"); InputError otherwise."""
    found = [lab for lab in labs if text in (lab, lab[:2])]
    if len(found) != 1:
        raise InputError(f"--through must name a lab, by number or name, e.g. {labs[0][:2]} "
                         f"or {labs[0]}; got {text!r} (labs: {', '.join(labs)})")
    return found[0]


def message(path: str, lab: str) -> str:
    return (f"Lab {lab[:2]} asks you to write this: {path} is a stub in this student edition "
            f"until the solutions of {lab} are released")


# --------------------------------------------------------------------------- one module's stubs


def module_of(src: Path, path: str) -> tuple[Path, str, str]:
    """(file, module, qualified name) of a dotted path: its longest module prefix under src."""
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        base = src.joinpath(*parts[:i])
        for file in (base.with_suffix(".py"), base / "__init__.py"):
            if file.is_file():
                return file, ".".join(parts[:i]), ".".join(parts[i:])
    raise ValueError(f"{path}: no module of it under {src}")


def _definition(tree: ast.Module, qualname: str) -> ast.stmt:
    """The statement defining `qualname` at the top of its module or class."""
    scope, node = tree.body, None
    for part in qualname.split("."):
        node = next((n for n in scope if part in _names(n)), None)
        if node is None:
            raise ValueError(f"{qualname}: not defined at the top of its module or class")
        scope = getattr(node, "body", [])
    return node


def _names(node: ast.stmt) -> set[str]:
    """What a statement defines: a def's or a class's name, an assignment's names."""
    if isinstance(node, ast.Assign):
        return {t.id for t in node.targets if isinstance(t, ast.Name)}
    return {node.name} if isinstance(node, ast.FunctionDef | ast.ClassDef) else set()


def _decorated(node: ast.stmt) -> list[str]:
    names = []
    for d in getattr(node, "decorator_list", []):
        d = d.func if isinstance(d, ast.Call) else d
        names.append(d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", ""))
    return names


def _header_end(lines: list[str], node: ast.FunctionDef | ast.ClassDef) -> int:
    """The line of a definition's closing `:` (its signature's or its bases')."""
    parts = [*node.bases, *node.keywords] if isinstance(node, ast.ClassDef) else [
        *node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs, node.args.vararg,
        node.args.kwarg, *node.args.defaults, *node.args.kw_defaults, node.returns]
    end = max([node.lineno] + [p.end_lineno for p in parts if p is not None])
    while not lines[end - 1].split("#")[0].rstrip().endswith(":"):
        end += 1
    return end


def _kept(lines: list[str], node: ast.FunctionDef | ast.ClassDef, decorators: bool) -> list[str]:
    """A definition's header (with its decorators or not) and docstring, nothing else."""
    first = node.body[0]
    end = _header_end(lines, node)
    if first.lineno == end:
        raise ValueError(f"{node.name}: a one-line definition cannot be stubbed")
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
            and isinstance(first.value.value, str):
        end = first.end_lineno
    start = min([node.lineno] + [d.lineno for d in node.decorator_list]) if decorators \
        else node.lineno
    return lines[start - 1:end]


def _raise(indent: str, text: str) -> list[str]:
    """`raise NotImplementedError(text)` at `indent`, its string cut into lines of 80."""
    parts = textwrap.wrap(text, 80, drop_whitespace=False)
    return [f"{indent}raise NotImplementedError("] + [
        f"{indent}    {part!r}" for part in parts[:-1]] + [f"{indent}    {parts[-1]!r})"]


def _raising(lines: list[str], node: ast.FunctionDef, text: str) -> list[str]:
    return _kept(lines, node, decorators=True) + _raise(" " * node.body[0].col_offset, text)


def _class_stub(lines: list[str], node: ast.ClassDef, text: str) -> list[str]:
    """The class's header, docstring and data, each method raising, construction raising."""
    indent = " " * node.body[0].col_offset
    out = _kept(lines, node, decorators=False)
    methods = [n for n in node.body if isinstance(n, ast.FunctionDef)]
    if "__init__" not in {m.name for m in methods}:
        out += ["", f"{indent}def __init__(self, *args, **kwargs):"] + _raise(indent + "    ", text)
    for n in node.body:
        if isinstance(n, ast.Assign | ast.AnnAssign):
            out += lines[n.lineno - 1:n.end_lineno]
        elif n in methods:
            out += [""] + _raising(lines, n, text)
    return out


def _literal(value: object, name: str) -> str:
    """Python source that rebuilds `value` exactly (a float32 value as a double is exact)."""
    if isinstance(value, torch.Tensor) and value.dim() == 1:
        items = textwrap.fill(", ".join(map(repr, value.tolist())), 92)
        return f"torch.tensor([\n{textwrap.indent(items, '    ')}], dtype={value.dtype})"
    raise ValueError(f"{name}: a stubbed function computes it at import, and a "
                     f"{type(value).__name__} cannot be written as its value")


def _frozen(tree: ast.Module, lines: list[str], module: str, names: set[str]
            ) -> list[tuple[int, int, list[str]]]:
    """Edits writing, as their values, the module constants that `names` compute at import."""
    edits = []
    for node in tree.body:
        calls = {c.func.id for c in ast.walk(node) if isinstance(c, ast.Call)
                 and isinstance(c.func, ast.Name)} if isinstance(node, ast.Assign) else set()
        if calls & names:
            (target,) = node.targets
            value = getattr(importlib.import_module(module), target.id)
            literal = _literal(value, f"{module}.{target.id}")
            edits.append((node.lineno, node.end_lineno, f"{target.id} = {literal}".splitlines()))
    return edits


def _stub_edits(lines: list[str], tree: ast.Module, node: ast.stmt, path: str, text: str
                ) -> list[tuple[int, int, list[str]]]:
    """The edits (first line, last line, new lines) stubbing one definition. A kernel (a
    @triton.jit def, or `name = triton.jit(fn)` with the functions it wraps) becomes an
    `_Unreleased` object."""
    start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    if isinstance(node, ast.Assign) or set(_decorated(node)) & set(KERNEL_DECORATORS):
        (name,) = _names(node)
        wrapped = {n.id for n in ast.walk(node.value) if isinstance(n, ast.Name)} \
            if isinstance(node, ast.Assign) else set()
        return [(start, node.end_lineno, [f"{name} = _Unreleased(", *_raise("", text)[1:]])] + [
            (min([f.lineno] + [d.lineno for d in f.decorator_list]), f.end_lineno,
             _raising(lines, f, text))
            for f in tree.body if isinstance(f, ast.FunctionDef) and f.name in wrapped]
    if isinstance(node, ast.ClassDef):
        return [(start, node.end_lineno, _class_stub(lines, node, text))]
    if isinstance(node, ast.FunctionDef):
        return [(start, node.end_lineno, _raising(lines, node, text))]
    raise ValueError(f"{path}: not a function, class or kernel")


def _imported(tree: ast.Module) -> dict[str, int]:
    """{name a top-level import binds: the line of its alias}."""
    return {alias.asname or alias.name.split(".")[0]: alias.lineno for node in tree.body
            if isinstance(node, ast.Import | ast.ImportFrom) for alias in node.names}


def _loaded(tree: ast.Module) -> set[str]:
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}


def _unused_imports(before: ast.Module, lines: list[str]) -> list[int]:
    """The lines (0-based) of `lines` importing a name only the stubbed bodies used: a linter
    would call it unused, and the stubs keep the module's imports as they were."""
    after = ast.parse("\n".join(lines))
    gone = (_loaded(before) - _loaded(after)) & set(_imported(after))
    return sorted({_imported(after)[name] - 1 for name in gone})


def stub_module(file: Path, module: str, targets: dict[str, tuple[str, str]]) -> None:
    """Rewrite `file`, the source of `module`, with each qualified name of `targets`
    ({qualname: (dotted path, lab)}) stubbed; the rest of the file is kept as it is."""
    lines = file.read_text(encoding="utf-8").splitlines()
    tree = ast.parse("\n".join(lines))
    edits = [edit for qualname, (path, lab) in targets.items()
             for edit in _stub_edits(lines, tree, _definition(tree, qualname), path,
                                     message(path, lab))]
    edits += _frozen(tree, lines, module, {q for q in targets if "." not in q})
    if kernels := [start for start, _, new in edits if new[0].endswith("= _Unreleased(")]:
        edits.append((min(kernels), min(kernels) - 1, UNRELEASED.splitlines()))
    for start, end, new in sorted(edits, key=lambda e: (e[0], e[1]), reverse=True):
        lines[start - 1:end] = new                    # bottom up: earlier lines keep their place
    for i in _unused_imports(tree, lines):
        lines[i] += "  # noqa: F401 (the stubbed code used it)"
    labs = dict(sorted((q, lab) for q, (_, lab) in targets.items()))
    lines += ["", "", "# The student edition: what this module stubs, and the lab asking for it.",
              *f"__unreleased__ = {pprint.pformat(labs, width=80)}".splitlines()]
    file.write_text("\n".join(lines) + "\n", encoding="utf-8")


def stub_sources(src: Path, stubs: dict[str, str]) -> None:
    """Stub every dotted path of `stubs` ({path: lab}) in the package sources under `src`."""
    by_file: dict[tuple[Path, str], dict[str, tuple[str, str]]] = {}
    for path, lab in stubs.items():
        file, module, qualname = module_of(src, path)
        by_file.setdefault((file, module), {})[qualname] = (path, lab)
    for (file, module), targets in sorted(by_file.items()):
        inner = {q for q in targets if any(q.startswith(f"{o}.") for o in targets)}
        stub_module(file, module, {q: t for q, t in targets.items() if q not in inner})


# ------------------------------------------------------------------------------------ editions


def _copy(root: Path, dest: Path, paths: tuple[str, ...]) -> None:
    ignore = shutil.ignore_patterns(*SKIPPED)
    for name in paths:
        source = root / name
        if source.is_dir():
            shutil.copytree(source, dest / name, symlinks=True, ignore=ignore)
        elif source.is_file():
            shutil.copy2(source, dest / name)


def _check_out(root: Path, out: Path) -> None:
    """Refuse an OUT inside what is copied, or a non-empty folder that is no edition."""
    inside = out == root or (root in out.parents
                             and out.relative_to(root).parts[0] in STUDENT_PATHS)
    if inside:
        raise InputError(f"{out} is inside the course's own files: choose a folder elsewhere")
    if out.exists() and not (out / EDITION_FILE).is_file() and (
            not out.is_dir() or any(out.iterdir())):
        raise InputError(f"{out} exists and is not an earlier student edition (no "
                         f"{EDITION_FILE}): choose an empty or new folder")


def _move_into_place(tmp: Path, out: Path) -> None:
    """Rename the finished `tmp` to `out`; an earlier edition (or empty folder) there goes."""
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        out.rename(old / "edition")
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old)


def build_edition(root: Path, out: Path, through: str | None = None) -> dict[str, str]:
    """Write the student edition of the course at `root` to `out`, its references released
    through lab `through` (a number or name; None: none); the stubbed {path: lab}."""
    root, out = root.resolve(), out.resolve()
    through = lab_called(through, lab_names(root)) if through is not None else None
    _check_out(root, out)
    stubs = stubbed(through)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.new-", dir=out.parent))
    try:
        _copy(root, tmp, STUDENT_PATHS)
        stub_sources(tmp / "src", stubs)
        record = {"through": through, "stubbed": stubs}
        (tmp / EDITION_FILE).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        tmp.chmod(0o755)
        _move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return stubs


def grading_src(root: Path, dest: Path, graded: str) -> Path:
    """dest/src: the course's src/ as the edition lab `graded` is graded in has it (see the
    module docstring), for the sandbox to mount over <course>/src."""
    labs = lab_names(root)
    before = labs[labs.index(graded) - 1] if labs.index(graded) else None
    src = dest / "src"
    shutil.copytree(root / "src", src, symlinks=True, ignore=shutil.ignore_patterns(*SKIPPED))
    stub_sources(src, stubbed(before, graded))
    return src
