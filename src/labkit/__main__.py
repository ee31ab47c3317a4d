"""python -m labkit run|reproduce|course|grade|check-exercises|check|work|lab — see README.md.

Exit codes: 0 success; 1 a reproduce that did not reproduce, or failing checks;
2 bad input (missing, malformed or edited manifest, changed files, unknown lab).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .errors import InputError

# The course subcommands import labkit.course (jupytext, nbgrader) inside their functions, so
# that `run` and `reproduce` need only the runtime dependencies.


def _run(args) -> int:
    from .experiment import run_experiment

    manifest = run_experiment(args.experiment)
    print(f"wrote {Path(args.experiment) / 'manifest.json'} "
          f"({manifest['wall_time_s']:.1f} s, peak {manifest['peak_memory_mb']:.0f} MB)")
    return 0


def _reproduce(args) -> int:
    from .experiment import reproduce

    report = reproduce(args.manifest)
    print(report.summary())
    return 0 if report.ok else 1


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
    p = sub.add_parser("run", help="run experiments/NN-name and write its manifest")
    p.add_argument("experiment")
    p.set_defaults(func=_run)
    p = sub.add_parser("reproduce", help="re-run a manifest's experiment and compare")
    p.add_argument("manifest")
    p.set_defaults(func=_reproduce)
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
    args, extra = parser.parse_known_args(argv)     # `lab` passes the rest to jupyter lab
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
