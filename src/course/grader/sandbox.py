"""The bubblewrap sandbox one submission's kernel runs in (threat model: labs/INSTRUCTORS.md).

    bwrap  read-only: /usr /etc (+ /bin /lib... links), Python, the venv, <course>/src
                      (`Sandbox.src` mounted there: grading mounts the student edition's,
                      course.authoring.edition), <course>/experiments (the base weights)
           /home/student, /tmp: tmpfs of their own, size-limited (Limits.home_bytes,
                      tmp_bytes), the kernel's working folder and scratch
           /run/course: a private folder of the grader's holding the connection file and
                      the kernel's sockets; as root, closed to new files once the kernel
                      listens (`seal`), so nothing else reaches the host's disk
           absent:    solutions/, build/ (gradebook, sources, grades), other submissions,
                      the network, the host's processes (own PID namespace, killed with it)
    -> setpriv  (as root) a uid of its own per submission, no capabilities; otherwise a
                user namespace in which no further one can be made (--disable-userns)
    -> prlimit  address space, file size, processes, open files, no core files
    -> python -m ipykernel_launcher -f /run/course/kernel.json

Where cgroups allow it (v2, or v1's memory and pids hierarchies), the whole sandbox also runs
in a cgroup of its own (cgroup.py): memory and tasks (and on v2 CPU weight) counted for all
its processes and tmpfs pages together.

Without bubblewrap the grader refuses to run unless `unsafe` is set; then the kernel runs as
the grader's user with the same limits and a private cwd, but sees the whole machine.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from labkit.errors import InputError

INSIDE = Path("/home/student")      # the kernel's home and working folder (a tmpfs)
RUN = Path("/run/course")           # the private folder (connection file, sockets) inside
SANDBOX_UID = 60000                 # + slot: a uid per parallel job, so limits are per job
# As root, each submission gets a uid never used by the one before it in its slot, so that
# what the kernel keeps per uid (its keyring) cannot reach the next submission.
FRESH_UIDS = itertools.count()
UID_CYCLE = 100_000
# Run in a sandbox by `check`: Python starts, and where the venv finds the packages, if at all.
PROBE = ("import importlib.util, torch\nspec = importlib.util.find_spec('miniquant')\n"
         "print(spec.origin if spec else '')")
INSTALL_HINT = ("install bubblewrap (Debian/Ubuntu: `sudo apt-get install bubblewrap`; "
                "Fedora: `sudo dnf install bubblewrap`), or pass --unsafe-no-sandbox to grade "
                "without one (student code then runs with your permissions)")


@dataclass(frozen=True)
class Limits:
    """prlimit limits of one kernel (each submission gets a fresh kernel)."""
    memory_bytes: int = 16 << 30     # address space; torch + Triton reserve several GiB
    file_bytes: int = 256 << 20      # largest file it may write
    processes: int = 1024            # threads count too (torch starts one per core)
    open_files: int = 1024
    cpu_seconds: int = 4 * 3600      # CPU time of the whole kernel (one thread per kernel)
    tmp_bytes: int = 1 << 30         # the sandbox's /tmp, a tmpfs of this size (not the host's)
    home_bytes: int = 256 << 20      # its /home/student, likewise

    def prlimit(self, processes: bool) -> list[str]:
        return (["prlimit", f"--as={self.memory_bytes}", f"--fsize={self.file_bytes}",
                 f"--nofile={self.open_files}", f"--cpu={self.cpu_seconds}", "--core=0"]
                + ([f"--nproc={self.processes}"] if processes else []) + ["--"])


def _ro_binds(course: Path) -> list[Path]:
    """Host paths the kernel needs to read: the system, Python, the venv, the course's code."""
    paths = [Path(p) for p in ("/usr", "/etc", "/opt") if Path(p).is_dir()]
    paths += [Path(sys.base_prefix).resolve(), Path(sys.prefix).resolve(),
              course / "src", course / "experiments"]
    return [p for p in dict.fromkeys(paths) if p.exists()]


def _dirs_for(path: Path) -> list[str]:
    """bwrap arguments creating path's ancestors world-readable (bwrap's default is 0700);
    /tmp is the sandbox's own tmpfs (mode 1777) and is left as it is."""
    args = []
    for parent in reversed(path.parents[:-1]):
        if parent != Path("/tmp"):
            args += ["--perms", "0755", "--dir", str(parent)]
    return args


@dataclass(frozen=True)
class Sandbox:
    course: Path             # the course checkout (src/ and experiments/ are read from it)
    unsafe: bool = False     # no bubblewrap: limits only
    limits: Limits = Limits()
    cgroups: bool = False    # a cgroup per kernel (grading.grade turns it on where it works)
    own_env: bool = False    # unsafe only: the user's own environment (`make check` on their
                             # machine, where the kernel is to see what their Jupyter sees)
    src: Path | None = None  # mounted as <course>/src instead of it (sandboxed only: the venv's
                             # editable install imports the packages from that path)

    def env(self, home: Path = INSIDE) -> dict[str, str]:
        """The kernel's whole environment: nothing of the grader's leaks in (with `own_env`,
        the user's, plus the inline plots and quiet progress bars of a notebook). Without a
        sandbox, its temporary files go in `home`/tmp, removed with the kernel (`prepare`)."""
        scratch = {"TMPDIR": f"{home}/tmp"} if self.unsafe else {}
        if self.own_env and self.unsafe:
            return {**os.environ, "MPLBACKEND": "module://matplotlib_inline.backend_inline",
                    "PYTHONDONTWRITEBYTECODE": "1", "TQDM_MININTERVAL": "5", **scratch}
        return {**scratch, "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": home,
                "LANG": "C.UTF-8", "MPLBACKEND": "module://matplotlib_inline.backend_inline",
                "MPLCONFIGDIR": f"{home}/.config/matplotlib", "NBGRADER_EXECUTION": "autograde",
                "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1",
                "TRITON_INTERPRET": "1", "TQDM_MININTERVAL": "5"}

    def uid(self, slot: int) -> int:
        """A fresh uid for the next submission in `slot` (as root; see FRESH_UIDS)."""
        return 200_000 + (next(FRESH_UIDS) % UID_CYCLE) * 64 + slot % 64

    def command(self, argv: list[str], private: Path, slot: int,
                uid: int | None = None) -> list[str]:
        """The command line running `argv` in the sandbox, `private` mounted as INSIDE; as
        root, as `uid` (default: the slot's fixed one)."""
        as_root = os.geteuid() == 0
        if self.unsafe:
            return self.limits.prlimit(processes=False) + argv
        args = ["bwrap", "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
                "--unshare-cgroup-try", "--die-with-parent", "--new-session",
                "--hostname", "sandbox", "--proc", "/proc", "--dev", "/dev",
                "--perms", "1777", "--size", str(self.limits.tmp_bytes), "--tmpfs", "/tmp",
                "--clearenv"]
        for name in ("bin", "sbin", "lib", "lib32", "lib64"):
            host = Path("/") / name
            if host.is_symlink():
                args += ["--symlink", os.readlink(host), str(host)]
            elif host.is_dir():
                args += ["--ro-bind", str(host), str(host)]
        for path in _ro_binds(self.course):
            source = self.src if self.src and path == self.course / "src" else path
            args += _dirs_for(path) + ["--ro-bind", str(source), str(path)]
        args += _dirs_for(INSIDE) + ["--perms", "1777", "--size", str(self.limits.home_bytes),
                                     "--tmpfs", str(INSIDE), "--chdir", str(INSIDE)]
        args += _dirs_for(RUN) + ["--bind", str(private), str(RUN)]
        for key, value in self.env().items():
            args += ["--setenv", key, value]
        if as_root:      # drop to a uid of the slot's own, so --nproc counts only this job
            uid = str(SANDBOX_UID + slot if uid is None else uid)
            args += ["--cap-add", "CAP_SETUID,CAP_SETGID", "--", "setpriv", f"--reuid={uid}",
                     f"--regid={uid}", "--clear-groups", "--inh-caps=-all",
                     "--bounding-set=-all"]
        else:            # no user namespaces inside this one (bwrap needs --unshare-user)
            args += ["--unshare-user", "--disable-userns", "--"]
        return args + self.limits.prlimit(processes=as_root) + argv

    def prepare(self, private: Path, slot: int, uid: int | None = None) -> None:
        """Make `private` the sandbox user's own (when the grader runs as root); without a
        sandbox, give it the kernel's scratch folder (`env`'s TMPDIR)."""
        if self.unsafe:
            (private / "tmp").mkdir(exist_ok=True)
        if not self.unsafe and os.geteuid() == 0:
            uid = SANDBOX_UID + slot if uid is None else uid
            os.chown(private, uid, uid)
        private.chmod(0o700)

    def seal(self, private: Path) -> None:
        """As root, once the kernel listens: `private` becomes root's, so the sandbox can use
        its sockets but create nothing more on the host's disk."""
        if not self.unsafe and os.geteuid() == 0:
            os.chown(private, 0, 0)
            private.chmod(0o711)

    def check(self) -> None:
        """Raise InputError saying why, when a sandbox cannot start here."""
        if self.unsafe:
            return
        for tool in ("bwrap", "prlimit") + (("setpriv",) if os.geteuid() == 0 else ()):
            if shutil.which(tool) is None:
                raise InputError(f"cannot sandbox the submissions: `{tool}` is not installed; "
                                 + INSTALL_HINT)
        probe = Path(os.environ.get("TMPDIR", "/tmp")) / f"labkit-probe-{os.getpid()}"
        probe.mkdir(exist_ok=True)
        try:
            self.prepare(probe, 0)
            proc = subprocess.run(self.command([sys.executable, "-c", PROBE], probe, 0),
                                  capture_output=True, text=True, timeout=120, env={})
        finally:
            shutil.rmtree(probe, ignore_errors=True)
        if proc.returncode != 0:
            raise InputError("cannot sandbox the submissions: bubblewrap failed to start "
                             f"Python ({proc.stderr.strip()[-300:]}); on some systems "
                             "unprivileged user namespaces are disabled "
                             "(sysctl kernel.unprivileged_userns_clone=1); " + INSTALL_HINT)
        src, found = self.course / "src", Path(proc.stdout.strip())
        if src not in found.parents:      # the src mounted there would not be the one imported
            where = f"in {found.parent}" if found.is_absolute() else "nowhere"
            raise InputError(f"the sandbox finds the course packages {where}, not in {src}: "
                             "install the course editable from this checkout (`pip install -e "
                             ".`, as `make venv` does)")
