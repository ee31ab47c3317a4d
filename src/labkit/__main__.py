"""python -m labkit run|reproduce|fingerprint|report|readme|course|grade|check-exercises|check|
mine|times|work|lab —
see README.md.

Exit codes: 0 success; 1 a reproduce that did not reproduce, a stale fingerprint, or failing
checks; 2 bad input (missing, malformed or edited manifest, changed files, unknown lab, a CPU
the pinned numerical mode cannot run on).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from .errors import InputError
from .numerics import DEFAULT_THREADS, check_can_pin, check_pinned, overridden, relaunch_pinned

# The course subcommands import labkit.course (jupytext, nbgrader) inside their functions, so
# that `run` and `reproduce` need only the runtime dependencies.


def _threads(path: Path, *keys: str) -> int:
    """The `threads` a config asks for (default 2), read before torch loads; a file that cannot
    be read gives the default here and its real error in the pinned child."""
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
        for key in keys:
            cfg = cfg[key]
        threads = cfg.get("threads", DEFAULT_THREADS)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return DEFAULT_THREADS
    return threads if isinstance(threads, int) and threads >= 1 else DEFAULT_THREADS


def _pin(args, threads: int) -> int | None:
    """None: go on in this process (pinned, or --numerics native). Otherwise the exit code of
    the same command re-run in a child process under the pin (libraries read it at load)."""
    if args.numerics == "native":
        return None
    check_can_pin()
    if overridden(threads) and os.environ.get("LABKIT_PINNED_CHILD") != f"threads={threads}":
        return relaunch_pinned(args.argv, threads)
    check_pinned(threads)
    return None


def _run(args) -> int:
    from .experiment import run_experiment

    exp = Path(args.experiment)
    code = _pin(args, _threads(exp / "config.json"))
    if code is not None:
        return code
    manifest = run_experiment(exp)
    print(f"wrote {exp / 'manifest.json'} "
          f"({manifest['wall_time_s']:.1f} s, peak {manifest['peak_memory_mb']:.0f} MB)")
    if (exp / "tiny.json").is_file():       # its fingerprint, in a fresh process of its own
        return subprocess.call([sys.executable, "-m", "labkit", "fingerprint", str(exp),
                                "--write", "--numerics", args.numerics])
    return 0


def _reproduce(args) -> int:
    from .experiment import code_preview, reproduce
    from .manifest import read_manifest

    code = _pin(args, _threads(Path(args.manifest), "config"))
    if code is not None:
        return code
    manifest_path = Path(args.manifest)
    print("\n".join(code_preview(read_manifest(manifest_path), manifest_path.parent.resolve())),
          flush=True)
    report = reproduce(manifest_path)
    print(report.summary())
    return 0 if report.ok else 1


def _fingerprint(args) -> int:
    from .fingerprint import check_fingerprint, write_fingerprint

    if args.note is not None and not args.write:
        raise InputError("--note goes with --write (it records why a refreshed fingerprint "
                         "needs no new full run)")
    exp = Path(args.experiment)
    code = _pin(args, _threads(exp / "tiny.json"))
    if code is not None:
        return code
    if args.write:
        write_fingerprint(exp, note=args.note)
        print(f"wrote {exp / 'fingerprint.json'}")
        return 0
    report = check_fingerprint(exp)
    print(report.summary())
    return 0 if report.ok else 1


def _report(args) -> int:
    from .report import REPORT, write_report

    path = Path(args.experiment) / REPORT
    if args.check:
        if write_report(Path(args.experiment), check=True):
            return 0
        print(f"{path} is out of date with its manifest: run python -m labkit report "
              f"{args.experiment}", file=sys.stderr)
        return 1
    in_sync = write_report(Path(args.experiment))
    print(f"{path} already matches its manifest" if in_sync else f"wrote {path}")
    return 0


def _readme(args) -> int:
    from .readme import write_readme

    if args.check:
        if write_readme(Path(args.root), check=True):
            return 0
        print("README.md is out of date with the manifests: run make readme", file=sys.stderr)
        return 1
    in_sync = write_readme(Path(args.root))
    print("README.md already matches the manifests" if in_sync else "wrote README.md")
    return 0


def _course(args) -> int:
    from .course.build import build_course

    build_course(Path(args.root), check=args.check)
    return 0


def _cell_timeout(args) -> int:
    """--timeout, or the course's per-cell limit when it was not given."""
    from .course.build import CELL_TIMEOUT_S

    return CELL_TIMEOUT_S if args.timeout is None else args.timeout


def _grade(args) -> int:
    from .course.grading import grade, merge_into, read_csv

    out = Path(args.out) if args.out else Path(args.root) / "build" / "grades"
    if args.merge:
        rows = merge_into(out / "grades.csv", [r for p in args.merge for r in read_csv(Path(p))])
        print(f"merged {len(args.merge)} grades.csv file(s) into {out / 'grades.csv'}: "
              f"{len(rows)} row(s)")
    if args.submissions:
        grade(Path(args.submissions), Path(args.root), out, timeout=_cell_timeout(args),
              force=args.force, course=Path(args.course) if args.course else None,
              jobs=args.jobs, unsafe_no_sandbox=args.unsafe_no_sandbox)
    elif not args.merge:
        raise InputError("give a SUBMISSIONS folder to grade, or --merge grades.csv files")
    return 0


def _check_exercises(args) -> int:
    from .course.exercises import check_exercises

    return 0 if check_exercises(Path(args.root), labs=args.labs) else 1


def _which_lab(root: Path) -> InputError:
    """The error for `check` without a lab: how to call it, and the labs there are."""
    from .course.learner import released_labs

    labs = ", ".join(released_labs(root)) or f"none found under {root / 'labs'}"
    return InputError("say which lab to check: `make check LAB=NN-name` or "
                      f"`python -m labkit check NN-name` (labs: {labs})")


def _check(args) -> int:
    if args.lab is None:
        raise _which_lab(Path(args.root))
    from .course.exercises import self_check

    notebook = Path(args.notebook) if args.notebook else None
    return 0 if self_check(Path(args.root), args.lab, notebook,
                           timeout=_cell_timeout(args)) else 1


def _mine(args) -> int:
    from .course.mine import default_root, status

    return status(Path(args.root).resolve() if args.root else default_root())


def _times(args) -> int:
    from .course.build import lab_names
    from .course.runtimes import TABLE, measure, problems, require_inline_markers, write

    root = Path(args.root).resolve()
    labs = args.labs or lab_names(root)
    require_inline_markers(root)             # before minutes of measuring, not after
    table = None if args.fill else measure(root, labs, repeat=args.repeat)
    if table is not None and args.labs:      # a partial run updates those labs only
        old = json.loads((root / TABLE).read_text())
        table = {**table, "labs": {**old["labs"], **table["labs"]}}
    for path in write(root, table):
        print(f"refilled the runtime markers of {path.relative_to(root)}")
    found = problems(root, lab_names(root))
    print("\n".join(found) or f"{TABLE}: every stated runtime agrees with the table")
    return 1 if found else 0


def _work(args) -> int:
    from .course.learner import make_work_copies, report_work_copies

    report_work_copies(Path(args.root), make_work_copies(Path(args.root)))
    return 0


def _lab(args) -> int:
    from .course.labserver import serve

    _work(args)
    serve(Path(args.root), args.mode, args.jupyter_args)
    return 0


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labkit", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    numerics_help = ("pinned (default): the same bits on any x86-64 CPU with AVX2, whatever "
                     "its cores (see labkit/numerics.py); native: this machine's own kernels "
                     "and threads, compared within tolerances elsewhere")
    p = sub.add_parser("run", help="run experiments/NN-name and write its manifest "
                       "(and its fingerprint, when it has a tiny.json)")
    p.add_argument("experiment")
    p.add_argument("--numerics", choices=["pinned", "native"], default="pinned",
                   help=numerics_help)
    p.set_defaults(func=_run)
    p = sub.add_parser("reproduce", help="re-run a manifest's experiment and compare")
    p.add_argument("manifest")
    p.add_argument("--numerics", choices=["pinned", "native"], default="pinned",
                   help=numerics_help)
    p.set_defaults(func=_reproduce)
    p = sub.add_parser("fingerprint", help="re-run an experiment's tiny.json and compare it bit "
                       "for bit with its fingerprint.json (stale experiments fail)")
    p.add_argument("experiment")
    p.add_argument("--write", action="store_true",
                   help="record the fingerprint instead of checking it")
    p.add_argument("--note", help="with --write, without re-recording the full run: the "
                   "reviewed reason the full run's numbers cannot have moved")
    p.add_argument("--numerics", choices=["pinned", "native"], default="pinned",
                   help=numerics_help)
    p.set_defaults(func=_fingerprint)
    p = sub.add_parser("report", help="write an experiment's REPORT.md again from its manifest "
                       "(experiment.py's report(manifest)), without re-running it")
    p.add_argument("experiment")
    p.add_argument("--check", action="store_true",
                   help="do not write REPORT.md; fail if it differs from the manifest's")
    p.set_defaults(func=_report)
    p = sub.add_parser("readme", help="fill README.md's generated blocks from the experiments' "
                       "manifests (their summary.py files)")
    p.add_argument("--root", default=".", help="the course checkout")
    p.add_argument("--check", action="store_true",
                   help="do not write README.md; fail if it differs from the manifests")
    p.set_defaults(func=_readme)
    p = sub.add_parser("course", help="build the nbgrader course and refresh labs/")
    p.add_argument("--root", default=".", help="the course checkout")
    p.add_argument("--check", action="store_true",
                   help="do not write labs/; fail if it differs from a fresh build")
    p.set_defaults(func=_course)
    timeout_help = "seconds a cell may run before it is stopped (default: the course's limit, " \
                   "CELL_TIMEOUT_S in labkit/course/build.py)"
    p = sub.add_parser("grade", help="autograde SUBMISSIONS/<student>/<NN-name>.ipynb "
                       "(or SUBMISSIONS/submitted/<student>/<NN-name>/<NN-name>.ipynb)")
    p.add_argument("submissions", nargs="?")
    p.add_argument("--root", default=".", help="the course checkout")
    p.add_argument("--out", help="where grades.csv, feedback/ and journal/ go "
                   "(default build/grades)")
    p.add_argument("--jobs", type=_positive_int, default=None,
                   help="submissions graded at once, each in its own sandbox "
                   "(default: the number of cores)")
    p.add_argument("--unsafe-no-sandbox", action="store_true",
                   help="grade without bubblewrap: student code runs with your permissions")
    p.add_argument("--merge", nargs="+", metavar="CSV",
                   help="grades.csv files of other runs (shards of a class) to merge into "
                   "OUT/grades.csv first; a later file wins for the same student and lab")
    p.add_argument("--course", help="nbgrader course directory to grade in "
                   "(default build/course)")
    p.add_argument("--timeout", type=_positive_int, default=None, help=timeout_help)
    p.add_argument("--force", action="store_true",
                   help="grade again even submissions the journal says are unchanged")
    p.set_defaults(func=_grade)
    p = sub.add_parser("check-exercises", help="prove every solution region is graded")
    p.add_argument("--root", default=".")
    p.add_argument("labs", nargs="*", help="lab names (default: all)")
    p.set_defaults(func=_check_exercises)
    p = sub.add_parser("check", help="run a learner's notebook; pass/fail of each visible test")
    p.add_argument("lab", nargs="?", help="lab name, e.g. 00-setup-minigpt")
    p.add_argument("--notebook", help="the notebook to check "
                   "(default work/LAB.ipynb, your copy; else the blank release "
                   "labs/LAB/LAB.ipynb)")
    p.add_argument("--root", default=".")
    p.add_argument("--timeout", type=_positive_int, default=None, help=timeout_help)
    p.set_defaults(func=_check)
    p = sub.add_parser("mine", help="which of your saved pieces `use(\"mine\")` swaps in")
    p.add_argument("--root", default=None, help="the course checkout (default: found from "
                   "the working directory, or $MINIQLORA_ROOT)")
    p.set_defaults(func=_mine)
    p = sub.add_parser("times", help="run every solution notebook; write labs/runtimes.json "
                       "and the runtime markers of the guides, notebooks and README")
    p.add_argument("--root", default=".")
    p.add_argument("--repeat", type=_positive_int, default=1, help="runs per lab (median)")
    p.add_argument("--fill", action="store_true", help="refill the markers from the committed "
                   "table; measure nothing")
    p.add_argument("labs", nargs="*", help="lab names (default: all)")
    p.set_defaults(func=_times)
    p = sub.add_parser("work", help="copy each lab's release to work/NN-name.ipynb where "
                       "there is no copy yet (never overwrites)")
    p.add_argument("--root", default=".")
    p.set_defaults(func=_work)
    p = sub.add_parser("lab", allow_abbrev=False, help="make the copies in work/, then serve "
                       "JupyterLab on the checkout; other arguments go to `jupyter lab`")
    p.add_argument("--root", default=".")
    p.add_argument("--mode", choices=["learner", "instructor"], default="learner",
                   help="learner hides nbgrader's instructor tools (default %(default)s)")
    p.set_defaults(func=_lab)
    argv = sys.argv[1:] if argv is None else list(argv)
    args, extra = parser.parse_known_args(argv)     # `lab` passes the rest to jupyter lab
    args.argv = argv
    if extra and args.command != "lab":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.jupyter_args = extra
    try:
        return args.func(args)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
