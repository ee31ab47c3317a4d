"""python -m course COMMAND: the course's command line, by audience (README.md has the make twins).

learners      work, lab, check, mine
instructors   grade, edition (and lab --mode instructor)
developers    build, check-exercises, check-mistakes, times

Exit codes: 0 success; 1 failing checks or stale runtimes; 2 bad input (unknown lab, missing
folder, malformed file).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from labkit.errors import InputError, exit_code


def _build(args) -> int:
    from .authoring.build import build_course

    build_course(Path(args.root), check=args.check)
    return 0


def _cell_timeout(args) -> int:
    """--timeout, or the course's per-cell limit when it was not given."""
    from .authoring.build import CELL_TIMEOUT_S

    return CELL_TIMEOUT_S if args.timeout is None else args.timeout


def _grade(args) -> int:
    from .grader.grades_csv import merge_into, read_csv
    from .grader.grading import grade

    out = Path(args.out) if args.out else Path(args.root) / "build" / "grades"
    if args.merge:
        if missing := [shard for shard in args.merge if not Path(shard).is_file()]:
            raise InputError(f"--merge: no such grades.csv file: {', '.join(missing)}")
        for shard in args.merge:    # in order; each row settled against the one it replaces
            rows = merge_into(out / "grades.csv", read_csv(Path(shard)), f"merged from {shard}")
        print(f"merged {len(args.merge)} grades.csv file(s) into {out / 'grades.csv'}: "
              f"{len(rows)} row(s)")
    if args.submissions:
        grade(Path(args.submissions), Path(args.root), out, timeout=_cell_timeout(args),
              force=args.force, course=Path(args.course) if args.course else None,
              jobs=args.jobs, unsafe_no_sandbox=args.unsafe_no_sandbox)
    elif not args.merge:
        raise InputError("give a SUBMISSIONS folder to grade, or --merge grades.csv files")
    return 0


def _edition(args) -> int:
    from .authoring.edition import build_edition

    stubs = build_edition(Path(args.root), Path(args.out), args.through)
    labs = sorted(set(stubs.values()))
    print(f"wrote the student edition to {args.out}: {len(stubs)} references stubbed"
          + (f", written in {', '.join(labs)}" if labs else ""))
    return 0


def _check_exercises(args) -> int:
    from .authoring.exercises import check_exercises

    return 0 if check_exercises(Path(args.root), labs=args.labs) else 1


def _check_mistakes(args) -> int:
    from .authoring.mistakes import check_mistakes, refill

    if args.fill:
        for path in refill(Path(args.root)):
            print(f"refilled {path}")
        return 0
    return 0 if check_mistakes(Path(args.root), labs=args.labs, jobs=args.jobs,
                               write=args.write, first=args.first) else 1


def _which_lab(root: Path) -> InputError:
    """The error for `check` without a lab: how to call it, and the labs there are."""
    from .learner import released_labs

    labs = ", ".join(released_labs(root)) or f"none found under {root / 'labs'}"
    return InputError("say which lab to check: `make check LAB=NN-name` or "
                      f"`python -m course check NN-name` (labs: {labs})")


def _check(args) -> int:
    if args.lab is None:
        raise _which_lab(Path(args.root))
    from .grader.check import self_check

    notebook = Path(args.notebook) if args.notebook else None
    return 0 if self_check(Path(args.root), args.lab, notebook,
                           timeout=_cell_timeout(args)) else 1


def _mine(args) -> int:
    from .notebook.mine import default_root, status

    return status(Path(args.root).resolve() if args.root else default_root())


def _times(args) -> int:
    from .authoring.build import lab_names
    from .authoring.runtimes import TABLE, measure, problems, require_inline_markers, write

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
    from .learner import make_work_copies, report_work_copies

    report_work_copies(Path(args.root), make_work_copies(Path(args.root)))
    return 0


def _lab(args) -> int:
    from .labserver import serve

    _work(args)
    serve(Path(args.root), args.mode, args.jupyter_args)
    return 0


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    timeout_help = "seconds a cell may run before it is stopped (default: the course's limit, " \
                   "CELL_TIMEOUT_S in course/authoring/build.py)"
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
                   "OUT/grades.csv first; a later file's row wins for the same student and "
                   "lab, but a row without a grade never replaces a grade, and a lower grade "
                   "says so in its status (and on the console)")
    p.add_argument("--course", help="nbgrader course directory to grade in "
                   "(default build/course)")
    p.add_argument("--timeout", type=_positive_int, default=None, help=timeout_help)
    p.add_argument("--force", action="store_true",
                   help="grade again even submissions the journal says are unchanged")
    p.set_defaults(func=_grade)
    p = sub.add_parser("edition", help="write the student repository to OUT: what the labs "
                       "after --through ask learners to write is stubbed in its src/")
    p.add_argument("out", help="a new or empty folder, or an earlier edition to replace")
    p.add_argument("--through", help="release the references of the labs up to this one "
                   "(its number or name; default: none)")
    p.add_argument("--root", default=".", help="the course checkout")
    p.set_defaults(func=_edition)
    p = sub.add_parser("build", help="build the nbgrader course and refresh labs/")
    p.add_argument("--root", default=".", help="the course checkout")
    p.add_argument("--check", action="store_true",
                   help="do not write labs/; fail if it differs from a fresh build")
    p.set_defaults(func=_build)
    p = sub.add_parser("check-exercises", help="prove every solution region is graded")
    p.add_argument("--root", default=".")
    p.add_argument("labs", nargs="*", help="lab names (default: all)")
    p.set_defaults(func=_check_exercises)
    p = sub.add_parser("check-mistakes", help="make each catalogued mistake in the solution; "
                       "a visible test must fail naming its rule")
    p.add_argument("--root", default=".")
    p.add_argument("--jobs", type=_positive_int, default=1, help="mistakes run at once")
    p.add_argument("--write", action="store_true", help="record the verdicts in "
                   "labs/NN-name/mistakes.json and refill the guides' blocks")
    p.add_argument("--fill", action="store_true", help="refill the guides' blocks from the "
                   "recorded verdicts; run nothing")
    p.add_argument("--first", action="store_true", help="only the first mistake of each "
                   "exercise (CI's sample; records nothing)")
    p.add_argument("labs", nargs="*", help="lab names (default: all)")
    p.set_defaults(func=_check_mistakes)
    p = sub.add_parser("times", help="run every solution notebook; write labs/runtimes.json "
                       "and the runtime markers of the guides, notebooks and README")
    p.add_argument("--root", default=".")
    p.add_argument("--repeat", type=_positive_int, default=1, help="runs per lab (median)")
    p.add_argument("--fill", action="store_true", help="refill the markers from the committed "
                   "table; measure nothing")
    p.add_argument("labs", nargs="*", help="lab names (default: all)")
    p.set_defaults(func=_times)
    argv = sys.argv[1:] if argv is None else list(argv)
    args, extra = parser.parse_known_args(argv)     # `lab` passes the rest to jupyter lab
    if extra and args.command != "lab":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.jupyter_args = extra
    return exit_code(lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
