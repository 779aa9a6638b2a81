"""Run model-written Python in a separate process with resource limits: code a policy wrote is untrusted input.

What the sandbox limits (docs/tools.md says the same, for users):

* CPU time: ``RLIMIT_CPU`` (SIGXCPU at the limit, SIGKILL a second later), per process.
* Memory: ``RLIMIT_AS`` (address space; an allocation past it raises MemoryError in the code).
* Processes: ``RLIMIT_NPROC``. The kernel does not apply it to root, so when qerl runs as root the child drops
  to the unprivileged ``nobody`` user first (which also keeps it from writing root's files); otherwise the limit
  is the user's current number of tasks plus ``processes``, as the limit counts every process of the user.
* Files written: ``RLIMIT_FSIZE`` per file, ``RLIMIT_NOFILE`` open descriptors, no core dumps; the working
  directory is a fresh temporary directory, removed afterwards.
* Wall clock: the process group is killed (SIGKILL) at ``wall_s``; it is killed at the end in any case, so
  children left behind die with it.
* Environment: none of the parent's variables pass (no tokens or credentials); the child gets a fixed minimal
  set. stdin is /dev/null; stdout and stderr go to files capped by the file-size limit, and only their first
  (stdout) or last (stderr) ``output_chars`` characters come back.

What it does NOT isolate: the network (the code can open sockets), reading any file the user running qerl (or
``nobody``) can read, and other system calls. It is not a container, a seccomp filter or a VM: run untrusted
models' code on a machine (or in a container) that holds nothing they must not read.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from qerl_cli.errors import QerlError

# Runs in the child before the model's code: limits first, then the unprivileged user, then the code as __main__.
BOOTSTRAP = r"""
import json, os, resource, sys, traceback
c = json.loads(sys.argv[1])
for kind, soft, hard in c["limits"]:
    resource.setrlimit(getattr(resource, kind), (soft, hard))
if c["uid"] is not None:
    for name in c["preload"]:  # before the drop: the interpreter's own files may be root's alone
        try:
            __import__(name)
        except ImportError:
            pass
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS: no setuid binary or file capability raises it again
    libc.prctl(8, 1, 0, 0, 0)  # PR_SET_KEEPCAPS: keep the permitted set across setuid, to cut it to one below
    os.setgroups([])
    os.setgid(c["gid"])
    os.setuid(c["uid"])

    class _Head(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class _Caps(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    caps = (_Caps * 2)()
    caps[0].effective = caps[0].permitted = 1 << 2  # CAP_DAC_READ_SEARCH only: read (never write) like root
    if libc.capset(ctypes.byref(_Head(0x20080522, 0)), caps) != 0:
        libc.capset(ctypes.byref(_Head(0x20080522, 0)), (_Caps * 2)())  # none at all, then
    del libc, caps, _Head, _Caps, ctypes
if c["nproc"] is not None:
    resource.setrlimit(resource.RLIMIT_NPROC, (c["nproc"], c["nproc"]))
sys.argv = ["main.py"]
sys.excepthook = lambda t, e, tb: traceback.print_exception(t, e, tb.tb_next)
del c, kind, soft, hard
with open("main.py", encoding="utf-8") as _f:
    _src = _f.read()
del _f
exec(compile(_src, "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""

# the child's whole environment (nothing of the parent's passes); HOME and TMPDIR point into its directory
_BASE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8",
             "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
NOBODY = 65534
# standard modules imported before the child drops to ``nobody`` (it may not be able to read the interpreter's
# files afterwards, where the capability to read them is not granted)
PRELOAD = ("math", "cmath", "fractions", "decimal", "itertools", "functools", "collections", "statistics", "random",
           "re", "string", "heapq", "bisect", "datetime", "json")


@dataclass(frozen=True)
class SandboxLimits:
    """Per run. ``processes``: tasks the code may add (threads count too); ``output_chars``: kept per stream."""

    cpu_s: int = 5
    wall_s: float = 10.0
    memory_mb: int = 1024
    processes: int = 16
    file_mb: int = 16
    open_files: int = 64
    output_chars: int = 2000

    def check(self) -> None:
        for name in ("cpu_s", "wall_s", "memory_mb", "processes", "file_mb", "open_files", "output_chars"):
            if not getattr(self, name) > 0:
                raise QerlError(f"sandbox limit {name} must be > 0, got {getattr(self, name)}")


@dataclass
class SandboxResult:
    """``error`` is None when the code ran to exit status 0; otherwise one line saying what stopped it."""

    stdout: str
    stderr: str
    exit_code: int | None
    error: str | None
    truncated: bool
    seconds: float
    pid: int


def _drop_to() -> tuple[int, int] | None:
    """(uid, gid) of ``nobody`` when running as root (RLIMIT_NPROC does not bind root), else None."""
    if os.geteuid() != 0:
        return None
    try:
        import pwd

        entry = pwd.getpwnam("nobody")
        return entry.pw_uid, entry.pw_gid
    except (ImportError, KeyError):
        return NOBODY, NOBODY


def user_tasks(uid: int) -> int | None:
    """Processes and threads of ``uid`` now (what RLIMIT_NPROC counts), from /proc; None where there is none."""
    proc = Path("/proc")
    if not proc.is_dir():
        return None
    total = 0
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = dict(line.split(":", 1) for line in (entry / "status").read_text().splitlines() if ":" in line)
        except OSError:
            continue  # the process ended while we looked
        if int(fields.get("Uid", "-1").split()[0]) == uid:
            total += int(fields.get("Threads", "1").strip() or 1)
    return total


def _config(limits: SandboxLimits, drop: tuple[int, int] | None) -> dict:
    mb = 1 << 20
    caps = [("RLIMIT_CPU", limits.cpu_s, limits.cpu_s + 1), ("RLIMIT_AS", limits.memory_mb * mb, limits.memory_mb * mb),
            ("RLIMIT_FSIZE", limits.file_mb * mb, limits.file_mb * mb),
            ("RLIMIT_NOFILE", limits.open_files, limits.open_files), ("RLIMIT_CORE", 0, 0)]
    if drop is not None:
        nproc: int | None = limits.processes
    else:
        now = user_tasks(os.getuid())
        nproc = None if now is None else now + limits.processes
    return {"limits": caps, "uid": drop[0] if drop else None, "gid": drop[1] if drop else None, "nproc": nproc,
            "preload": PRELOAD}


def _head(path: Path, chars: int) -> tuple[str, bool]:
    with open(path, "rb") as f:
        raw = f.read(4 * chars + 4)
        more = bool(f.read(1))
    text = raw.decode("utf-8", errors="replace")
    return text[:chars], more or len(text) > chars


def _tail(path: Path, chars: int) -> tuple[str, bool]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        f.seek(max(0, size - 4 * chars))
        text = f.read().decode("utf-8", errors="replace")
    return text[-chars:], size > chars and len(text) > chars


def _explain(code: int | None, timed_out: bool, limits: SandboxLimits, stderr: str) -> str | None:
    if timed_out:
        return f"timed out: wall-clock limit of {limits.wall_s:g} s"
    if code == 0:
        return None
    if code is not None and code < 0:
        sig = -code
        if sig in (signal.SIGXCPU, signal.SIGKILL):
            return f"killed: CPU time limit of {limits.cpu_s} s"
        if sig == signal.SIGXFSZ:
            return f"killed: file size limit of {limits.file_mb} MB"
        return f"killed by signal {signal.Signals(sig).name}"
    last = next((line.strip() for line in reversed(stderr.splitlines()) if line.strip()), "")
    return f"exit code {code}" + (f": {last}" if last else "")


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run ``code`` as ``__main__`` in a fresh sandboxed process and return what it printed and how it ended."""
    limits = limits or SandboxLimits()
    limits.check()
    drop = _drop_to()
    root = Path(tempfile.mkdtemp(prefix="qerl-sandbox-"))
    try:
        work = root / "work"
        work.mkdir(mode=0o700)
        (work / "main.py").write_text(code, encoding="utf-8")
        if drop is not None:
            os.chown(work, *drop)
        env = dict(_BASE_ENV, HOME=str(work), TMPDIR=str(work))
        args = [sys.executable, "-I", "-B", "-u", "-c", BOOTSTRAP, json.dumps(_config(limits, drop))]
        t0 = time.perf_counter()
        with open(root / "stdout", "wb") as out, open(root / "stderr", "wb") as err:
            proc = subprocess.Popen(args, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    start_new_session=True, close_fds=True)
        timed_out = False
        try:
            proc.wait(timeout=limits.wall_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc.pid)
            proc.wait()
        finally:
            _kill_group(proc.pid)  # whatever the code left running in its group dies with it
        seconds = time.perf_counter() - t0
        stdout, cut_out = _head(root / "stdout", limits.output_chars)
        stderr, cut_err = _tail(root / "stderr", limits.output_chars)
        error = _explain(proc.returncode, timed_out, limits, stderr)
        return SandboxResult(stdout=stdout, stderr=stderr, exit_code=None if timed_out else proc.returncode,
                             error=error, truncated=cut_out or cut_err, seconds=seconds, pid=proc.pid)
    finally:
        shutil.rmtree(root, ignore_errors=True)
