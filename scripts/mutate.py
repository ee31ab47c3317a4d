"""A small AST mutation runner for the reference packages' math modules.

    .venv/bin/python scripts/mutate.py [--module miniquant.nf4 ...] [--out FILE] [--only QUALNAME]

For each target module it makes one mutant per (operator, AST node) inside the module's
functions and methods, and runs that module's narrow pytest selection against each mutant with
`-x`: a failing (or erroring, timed-out or crashed) run kills the mutant, a passing one lets it
survive.

How a mutant runs: this process imports torch, triton (the interpreter: TRITON_INTERPRET=1),
pytest and the packages once; for each mutant it forks, and the child compiles the mutated
module from its AST, swaps the mutated function's code object into the live function
(`f.__code__ = ...`, so every `from ... import f` sees it), clears the module's functools
caches, re-evaluates a top-level `NAME = f(...)` of the mutated function (in place for a
tensor, so NF4_CODE's importers see it too), and runs `pytest.main([...tests, "-x"])`. Nothing
on disk is changed. Forking saves the 5-10 s import per mutant that a subprocess would cost
on a 2-core machine.

Operators (mutmut's usual set): comparison flips (< <=, > >=, == !=, in / not in, is / is
not), arithmetic swaps (+ -, * /, // /, % /, << >>, & |, ** *; also in `x op= y`), and / or,
a dropped unary minus or `not`, an int or float constant + 1, True / False. Not mutated: text
(strings, f-strings: messages), whole `raise` statements (their message), decorators, default
values and annotations (evaluated once, at definition), module-level code.

Why not mutmut (3.8.1 is installed in the venv and works as a tool): it copies the project
into mutants/ inside the checkout, needs its [tool.mutmut] configuration in pyproject.toml,
starts with a clean run of the whole selection plus a per-test stats run, and skips every
decorated function other than static/class methods, so NF4Weight's properties (`absmax`,
`n_blocks`) and the functools.cache helpers would not be mutated at all.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import importlib
import json
import os
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# module -> source file, the top-level functions / classes mutated (None: all), its tests.
TARGETS = {
    "miniquant.nf4": dict(
        path="src/miniquant/nf4.py", scope=None,
        tests=["tests/miniquant/test_nf4.py", "tests/miniquant/test_bnb_parity.py"]),
    "minituner.lora": dict(
        path="src/minituner/lora.py", scope=("_LoRALinearFunction", "lora_linear"),
        tests=["tests/minituner/test_lora.py"]),
    "minimoe.routing": dict(
        path="src/minimoe/routing.py", scope=None,
        tests=["tests/minimoe/test_tiles.py", "tests/minimoe/test_call_surface.py"]),
    # The launchers' host code: shape / index / offset checks, tiles, grids, the rank block.
    # Not the GPU launch configuration (`_kernels`, `_autotuned`, `_launch`, `aligned`,
    # `_precision`): under the interpreter it is never reached or always answers "ieee", so
    # each of its mutants would survive at the cost of a whole run. The subprocess test sees
    # the files on disk, never an in-process mutant.
    "minimoe.ops": dict(
        path="src/minimoe/ops.py",
        scope=("expert_tiles", "_cdiv", "_check_float", "_check_same", "_check_index",
               "_require", "_range_check", "_checked_offsets", "check_expert_lora",
               "_rank_block", "scatter2scatter", "scatter2scatter_lora", "_scatter2scatter",
               "group", "group_bwd_W", "group_bwd_lora"),
        tests=["tests/minimoe/test_tiles.py", "tests/minimoe/test_kernels.py",
               "tests/minimoe/test_call_surface.py", "--deselect",
               "tests/minimoe/test_kernels.py::test_interpreted_even_after_triton_was_imported"]),
    "miniquant.triton_dequant": dict(
        path="src/miniquant/triton_dequant.py", scope=None,
        tests=["tests/miniquant/test_triton_dequant.py"]),
}

CMP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
       ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot,
       ast.IsNot: ast.Is}
BIN = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult,
       ast.FloorDiv: ast.Div, ast.Mod: ast.Div, ast.LShift: ast.RShift, ast.RShift: ast.LShift,
       ast.BitAnd: ast.BitOr, ast.BitOr: ast.BitAnd, ast.Pow: ast.Mult}
SYM = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!=",
       ast.In: "in", ast.NotIn: "not in", ast.Is: "is", ast.IsNot: "is not", ast.Add: "+",
       ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%",
       ast.LShift: "<<", ast.RShift: ">>", ast.BitAnd: "&", ast.BitOr: "|", ast.Pow: "**",
       ast.And: "and", ast.Or: "or"}


# -- mutant generation ----------------------------------------------------------------------

def _functions(tree: ast.Module, scope):
    """(qualname, def node) for the module's functions and its classes' methods."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            if scope is None or node.name in scope:
                yield node.name, node
        elif isinstance(node, ast.ClassDef) and (scope is None or node.name in scope):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    yield f"{node.name}.{item.name}", item


def _body_nodes(fn: ast.FunctionDef):
    """The nodes of fn's body that may be mutated, in a fixed order (skipping docstrings,
    f-strings, raise statements, nested defaults / decorators / annotations)."""
    out = []

    def visit(node):
        if isinstance(node, ast.JoinedStr | ast.Raise):
            return
        if isinstance(node, ast.FunctionDef | ast.Lambda):
            body = node.body if isinstance(node.body, list) else [node.body]
            for child in body:
                visit(child)
            return
        if isinstance(node, ast.arg | ast.arguments):
            return
        out.append(node)
        for child in ast.iter_child_nodes(node):
            if isinstance(node, ast.AnnAssign) and child is node.annotation:
                continue
            visit(child)

    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    for stmt in body:
        visit(stmt)
    return out


def _ops(node):
    """[(op id, description)] for one node."""
    ops = []
    if isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            ops.append((f"cmp{i}", f"{SYM[type(op)]} -> {SYM[CMP[type(op)]]}"))
    elif isinstance(node, ast.BinOp | ast.AugAssign) and type(node.op) in BIN:
        ops.append(("bin", f"{SYM[type(node.op)]} -> {SYM[BIN[type(node.op)]]}"))
    elif isinstance(node, ast.BoolOp):
        other = ast.Or if isinstance(node.op, ast.And) else ast.And
        ops.append(("bool", f"{SYM[type(node.op)]} -> {SYM[other]}"))
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.Not | ast.Invert):
        sym = {ast.USub: "-", ast.Not: "not", ast.Invert: "~"}[type(node.op)]
        ops.append(("unary", f"drop unary {sym}"))
    elif isinstance(node, ast.Constant):
        v = node.value
        if isinstance(v, bool):
            ops.append(("const", f"{v} -> {not v}"))
        elif isinstance(v, int | float):
            ops.append(("const", f"{v!r} -> {v + 1!r}"))
    return ops


def _apply(node, op_id: str, parent, field: str, index):
    """Mutate `node` (in its freshly parsed tree) in place; parent/field/index locate it."""
    if op_id.startswith("cmp"):
        i = int(op_id[3:])
        node.ops[i] = CMP[type(node.ops[i])]()
    elif op_id == "bin":
        node.op = BIN[type(node.op)]()
    elif op_id == "bool":
        node.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
    elif op_id == "const":
        node.value = (not node.value) if isinstance(node.value, bool) else node.value + 1
    elif op_id == "unary":
        if index is None:
            setattr(parent, field, node.operand)
        else:
            getattr(parent, field)[index] = node.operand
    else:
        raise AssertionError(op_id)


def _parents(tree):
    where = {}
    for parent in ast.walk(tree):
        for field, value in ast.iter_fields(parent):
            if isinstance(value, list):
                for i, child in enumerate(value):
                    if isinstance(child, ast.AST):
                        where[id(child)] = (parent, field, i)
            elif isinstance(value, ast.AST):
                where[id(value)] = (parent, field, None)
    return where


def mutants(module: str):
    """Every mutant of a target: dicts with qualname, node index, op, line, description."""
    spec = TARGETS[module]
    source = (ROOT / spec["path"]).read_text()
    tree = ast.parse(source)
    lines = source.splitlines()
    found = []
    for qualname, fn in _functions(tree, spec["scope"]):
        for n, node in enumerate(_body_nodes(fn)):
            for op_id, what in _ops(node):
                found.append(dict(qualname=qualname, node=n, op=op_id, line=node.lineno,
                                  what=what, code=lines[node.lineno - 1].strip()))
    return found


def mutated_code(module: str, m: dict):
    """The code object of m["qualname"] in the mutated module."""
    spec = TARGETS[module]
    path = ROOT / spec["path"]
    tree = ast.parse(path.read_text())
    fn = dict(_functions(tree, spec["scope"]))[m["qualname"]]
    node = _body_nodes(fn)[m["node"]]
    parent, field, index = _parents(tree)[id(node)]
    _apply(node, m["op"], parent, field, index)
    code = compile(ast.fix_missing_locations(tree), str(path), "exec")
    stack = [code]
    while stack:
        c = stack.pop()
        if c.co_qualname == m["qualname"]:
            return c
        stack.extend(k for k in c.co_consts if hasattr(k, "co_qualname"))
    raise LookupError(m["qualname"])


# -- running ---------------------------------------------------------------------------------

def _live_function(mod, qualname: str):
    obj = mod
    *outer, name = qualname.split(".")
    for part in outer:
        obj = getattr(obj, part)
    f = obj.__dict__[name]
    if isinstance(f, staticmethod | classmethod):
        f = f.__func__
    elif isinstance(f, property):
        f = f.fget
    while hasattr(f, "__wrapped__"):
        f = f.__wrapped__
    return f


def _patch(module: str, m: dict) -> None:
    import torch

    mod = importlib.import_module(module)
    _live_function(mod, m["qualname"]).__code__ = mutated_code(module, m)
    for value in list(vars(mod).values()):
        if hasattr(value, "cache_clear"):
            value.cache_clear()
    if "." in m["qualname"]:
        return
    # A module-level constant computed by the mutated function (NF4_CODE = nf4_codebook()).
    tree = ast.parse((ROOT / TARGETS[module]["path"]).read_text())
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 \
                and isinstance(stmt.targets[0], ast.Name) and isinstance(stmt.value, ast.Call) \
                and isinstance(stmt.value.func, ast.Name) and stmt.value.func.id == m["qualname"]:
            name = stmt.targets[0].id
            new = eval(compile(ast.Expression(stmt.value), "<const>", "eval"), vars(mod))
            old = getattr(mod, name)
            if isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor) \
                    and old.shape == new.shape and old.dtype == new.dtype:
                old.copy_(new)      # NF4_CODE is imported by name elsewhere: change it in place
            else:
                setattr(mod, name, new)


def _pytest_args(tests):
    return [*tests, "-x", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
            "--no-header", "-o", "console_output_style=classic"]


def run_one(module: str, m: dict | None, timeout: float, log: Path) -> tuple[str, float]:
    """Fork, patch (m None: no mutant), run the tests; 'killed', 'survived', 'timeout' or
    'crashed' (the tests' process died: counted as killed) or 'error' (the mutant could not be
    installed, or no test ran), and the seconds it took."""
    import pytest

    start = time.monotonic()
    pid = os.fork()
    if pid == 0:                                    # the child
        code = 90
        try:
            os.setpgid(0, 0)
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            if m is not None:
                _patch(module, m)
            code = 80
            code = int(pytest.main(_pytest_args(TARGETS[module]["tests"])))
        except BaseException as e:  # noqa: BLE001 - report and exit, never return to the loop
            print(f"runner: {type(e).__name__}: {e}", flush=True)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    deadline = start + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            try:
                os.killpg(pid, signal.SIGKILL)   # the child's own group (its subprocesses too)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
            return "timeout", time.monotonic() - start
        time.sleep(0.05)
    took = time.monotonic() - start
    rc = os.waitstatus_to_exitcode(status)
    if rc == 0:
        return "survived", took
    if rc in (1, 2, 3, 80):      # failed tests, a collection / import error, the run raised
        return "killed", took
    if rc < 0:                   # the test process died of a signal (the interpreter aborted)
        return "crashed", took
    return "error", took         # 90: the mutant could not be installed; 4, 5: no tests ran


def measure(module: str, only=None, lines=None, indices=None,
            log_dir=Path("/tmp/mutate-logs")) -> dict:
    log_dir.mkdir(parents=True, exist_ok=True)
    base_status, base_s = run_one(module, None, 900, log_dir / "baseline.log")
    if base_status != "survived":
        raise SystemExit(f"{module}: the unmutated tests do not pass ({base_status}); see "
                         f"{log_dir / 'baseline.log'}")
    timeout = 3 * base_s + 20
    all_mutants = mutants(module)
    chosen = [m for i, m in enumerate(all_mutants, 1) if (not only or m["qualname"] in only)
              and (not lines or m["line"] in lines) and (not indices or i in indices)]
    results = []
    for i, m in enumerate(chosen):
        index = all_mutants.index(m) + 1          # its number in the module's full list
        status, took = run_one(module, m, timeout, log_dir / f"{module}-{index}.log")
        results.append({**m, "index": index, "status": status, "seconds": round(took, 1)})
        print(f"{module} {i + 1}/{len(chosen)} #{index} {status:8s} {took:5.1f}s  "
              f"{m['qualname']} line {m['line']}: {m['what']}", flush=True)
    count = {s: sum(r["status"] == s for r in results)
             for s in ("killed", "timeout", "crashed", "survived", "error")}
    total = len(results) - count["error"]
    return {
        "source": TARGETS[module]["path"],
        "mutated": list(TARGETS[module]["scope"] or ["every function and method"]),
        "tests": TARGETS[module]["tests"],
        "baseline_seconds": round(base_s, 1),
        "mutants": len(results),
        **count,
        "detected": count["killed"] + count["timeout"] + count["crashed"],
        "score": round((count["killed"] + count["timeout"] + count["crashed"]) / total, 3)
        if total else None,
        "survivors": [{k: r[k] for k in ("index", "qualname", "line", "what", "code")}
                      for r in results if r["status"] == "survived"],
        "errors": [{k: r[k] for k in ("index", "qualname", "line", "what", "code")}
                   for r in results if r["status"] == "error"],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--module", action="append", choices=sorted(TARGETS),
                   help="a target (repeatable; default: all)")
    p.add_argument("--only", action="append", help="mutate only this function (qualname)")
    p.add_argument("--line", action="append", type=int, help="only mutants on this line")
    p.add_argument("--index", action="append", type=int,
                   help="only the mutant with this number in the module's --list (from 1)")
    p.add_argument("--list", action="store_true", help="list the mutants and exit")
    p.add_argument("--out", type=Path, help="write the JSON result here")
    args = p.parse_args(argv)
    modules = args.module or list(TARGETS)
    if args.list:
        for module in modules:
            for i, m in enumerate(mutants(module), 1):
                print(f"{module} #{i} {m['qualname']} line {m['line']}: {m['what']}")
        return 0
    os.chdir(ROOT)
    import pytest  # noqa: F401  (imported once, before the forks)
    import torch

    torch.set_num_threads(1)
    for module in modules:           # import everything the tests need once, in the parent
        importlib.import_module(module)
    import minigpt  # noqa: F401
    import minimoe.ops
    import miniquant.triton_dequant
    minimoe.ops._kernels()
    miniquant.triton_dequant._kernel_module()
    for optional in ("peft", "bitsandbytes"):
        try:
            importlib.import_module(optional)
        except ImportError:
            pass
    result = {
        "tool": "scripts/mutate.py (AST operator mutations, one forked pytest -x run each)",
        "command": "TRITON_INTERPRET=1 OMP_NUM_THREADS=1 .venv/bin/python scripts/mutate.py "
                   + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%MZ"),
        "modules": {},
    }
    for module in modules:
        result["modules"][module] = measure(module, args.only, args.line, args.index)
        r = result["modules"][module]
        print(f"== {module}: {r['detected']}/{r['mutants'] - r['error']} killed "
              f"({r['survived']} survived; {r['timeout']} by timeout, {r['crashed']} crashed; "
              f"{r['error']} errors)",
              flush=True)
        if args.out:
            args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    sys.exit(main())
