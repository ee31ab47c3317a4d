"""python -m labkit run|reproduce|fingerprint|report|readme: the experiments' command line
(experiments/README.md). The course's commands (lab, check, grade, ...) are `python -m course`.

Exit codes: 0 success; 1 a reproduce that did not reproduce, a stale fingerprint, or failing
checks; 2 bad input (missing, malformed or edited manifest, changed files, a moved command, a CPU
the pinned numerical mode cannot run on).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from .errors import InputError, exit_code
from .numerics import DEFAULT_THREADS, check_can_pin, check_pinned, overridden, relaunch_pinned

# The course's commands, which moved to `python -m course`: named here so that an old
# instruction gets one line saying where, not argparse's list of choices.
MOVED = ("lab", "work", "check", "mine", "grade", "course", "times", "check-exercises")


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

    if args.note is not None and not (args.write or args.add_cpu):
        raise InputError("--note goes with --write (it records why a refreshed fingerprint "
                         "needs no new full run) or --add-cpu")
    if args.write and args.add_cpu:
        raise InputError("--write records the fingerprint afresh, --add-cpu adds this CPU "
                         "vendor's tiny run to it: give one of them")
    exp = Path(args.experiment)
    code = _pin(args, _threads(exp / "tiny.json"))
    if code is not None:
        return code
    if args.write or args.add_cpu:
        write_fingerprint(exp, note=args.note, add_cpu=args.add_cpu)
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
    from .readme import docs, write_docs

    stale = write_docs(Path(args.root), check=args.check)
    if args.check:
        for doc in stale:
            print(f"{doc} is out of date with the manifests: run make readme", file=sys.stderr)
        return 1 if stale else 0
    for doc in stale:
        print(f"wrote {doc}")
    if not stale:
        print(f"{', '.join(docs(Path(args.root)))}: already match the manifests")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labkit", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    numerics_help = ("pinned (default): the same bits on any x86-64 CPU with AVX2 of one "
                     "vendor, whatever its cores (see labkit/numerics.py); native: this "
                     "machine's own kernels and threads, compared within tolerances elsewhere")
    for name, func, target, what in (
            ("run", _run, "experiment", "run experiments/NN-name and write its manifest (and "
             "its fingerprint, when it has a tiny.json)"),
            ("reproduce", _reproduce, "manifest", "re-run a manifest's experiment and compare")):
        p = sub.add_parser(name, help=what)
        p.add_argument(target)
        p.add_argument("--numerics", choices=["pinned", "native"], default="pinned",
                       help=numerics_help)
        p.set_defaults(func=func)
    p = sub.add_parser("fingerprint", help="re-run an experiment's tiny.json and compare it bit "
                       "for bit with its fingerprint.json (stale experiments fail)")
    p.add_argument("experiment")
    p.add_argument("--write", action="store_true",
                   help="record the fingerprint instead of checking it")
    p.add_argument("--add-cpu", action="store_true",
                   help="add this CPU vendor's tiny run to a fingerprint recorded on another "
                   "vendor (the pin holds within one vendor)")
    p.add_argument("--note", help="with --write, without re-recording the full run: the "
                   "reviewed reason the full run's numbers cannot have moved; with --add-cpu, "
                   "what this vendor's entry was checked against")
    p.add_argument("--numerics", choices=["pinned", "native"], default="pinned",
                   help=numerics_help)
    p.set_defaults(func=_fingerprint)
    p = sub.add_parser("report", help="write an experiment's REPORT.md again from its manifest "
                       "(experiment.py's report(manifest)), without re-running it")
    p.add_argument("experiment")
    p.add_argument("--check", action="store_true",
                   help="do not write REPORT.md; fail if it differs from the manifest's")
    p.set_defaults(func=_report)
    p = sub.add_parser("readme", help="fill the generated blocks of RESULTS.md and "
                       "experiments/README.md (and README.md, if it has any) from the "
                       "experiments' manifests and the benchmark results")
    p.add_argument("--root", default=".", help="the course checkout")
    p.add_argument("--check", action="store_true",
                   help="write nothing; fail naming each document that differs from the "
                   "manifests")
    p.set_defaults(func=_readme)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in MOVED:
        new = "build" if argv[0] == "course" else argv[0]
        print(f"error: `{argv[0]}` is a course command: python -m course {new} "
              f"{' '.join(argv[1:])}".rstrip(), file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    args.argv = argv
    return exit_code(lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
