"""Run model-written Python in a sandbox of its own per call: code a policy wrote is untrusted input.

The parent side: the call's directory, cgroup and uid, the launch of ``sandbox_child.py`` (the monitor, the
init of the call's PID namespace and the code; that file says what each does), the wall clock, the last check
that nothing of the call is left (``survivors``), and the one line saying why the call ended. Each layer is
tried and the ones that held come back in ``SandboxResult.layers`` (``capabilities()`` for this machine);
docs/tools.md has the table of what holds on which kernel and privilege.

* Nothing outlives the call: a PID namespace whose init kills every process at the end; a cgroup v2
  (``cgroup.kill``) where qerl may make one; a child subreaper and a /proc scan by session, uid and PID namespace
  where neither holds.
* Nothing of qerl's is in reach: an empty environment, a uid of its own per call when root (a user namespace with
  no capabilities otherwise), no_new_privs, not dumpable; a private /proc shows the call's processes only.
* Files: a private root (the system and interpreter directories read-only, a ``scratch_mb`` tmpfs for /tmp,
  /dev/shm and the working directory); landlock (writes only there) where the kernel has it.
* Network: a network namespace (no interface up); landlock refuses TCP connect and bind as well.
* Limits per call: CPU seconds of all its processes together (the init totals them), address space, file size,
  open files and processes per process (RLIMIT_*), memory.max and pids.max where the cgroup has the controllers,
  and the wall clock.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from qerl_cli.errors import QerlError

CHILD = Path(__file__).with_name("sandbox_child.py")  # the monitor, init and code processes (stdlib only)

# the child's whole environment (nothing of the parent's passes); HOME and TMPDIR point into its directory
_BASE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8",
             "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
NOBODY = 65534
# as root each call runs under a uid of its own, UID_BASE + (qerl's pid, a counter): no file on the system is
# its, RLIMIT_NPROC counts that call's processes only, and what it left running can be found by uid
UID_BASE = 1_500_000_000
# standard modules imported before the code's privileges drop (without a private root it may not be able to read
# the interpreter's files afterwards, as when the interpreter lives under root's home)
PRELOAD = ("math", "cmath", "fractions", "decimal", "itertools", "functools", "collections", "statistics", "random",
           "re", "string", "heapq", "bisect", "datetime", "json", "atexit", "threading", "resource", "socket",
           "subprocess", "struct", "array", "typing", "dataclasses", "textwrap", "operator", "copy", "hashlib")
# bound read-only into the private root, beside the interpreter's prefixes
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache",
                "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/passwd", "/etc/group",
                "/etc/nsswitch.conf")
# False: no namespaces (what a kernel without them gets), to check the fallback layers on one that has them
NAMESPACES = True
_calls = itertools.count()
_calls_lock = threading.Lock()


@dataclass(frozen=True)
class SandboxLimits:
    """Per call. ``cpu_s``: CPU seconds of all the call's processes together; ``memory_mb``: address space per
    process; ``scratch_mb``: the one tmpfs behind /tmp, /dev/shm and the working directory (memory too, counted
    apart); ``processes``: tasks the code may add (threads count too); ``output_chars``: kept per stream."""

    cpu_s: int = 5
    wall_s: float = 10.0
    memory_mb: int = 1024
    processes: int = 16
    file_mb: int = 16
    open_files: int = 64
    output_chars: int = 2000
    scratch_mb: int = 64

    def check(self) -> None:
        for name in ("cpu_s", "wall_s", "memory_mb", "processes", "file_mb", "open_files", "output_chars",
                     "scratch_mb"):
            if not getattr(self, name) > 0:
                raise QerlError(f"sandbox limit {name} must be > 0, got {getattr(self, name)}")


@dataclass
class SandboxResult:
    """``error`` is None when the code ran to exit status 0; otherwise one line saying what stopped it.
    ``layers``: the isolation that held for this call (``capabilities()``); ``survivors``: processes of the call
    still found after it ended and killed again (0 is the contract); ``cpu_s``: CPU seconds of all its processes."""

    stdout: str
    stderr: str
    exit_code: int | None
    error: str | None
    truncated: bool
    seconds: float
    pid: int
    layers: tuple[str, ...] = field(default_factory=tuple)
    survivors: int = 0
    cpu_s: float | None = None


def _uid_range() -> list[tuple[int, int]]:
    """(first, count) of the uids this process's user namespace maps."""
    try:
        lines = Path("/proc/self/uid_map").read_text().splitlines()
    except OSError:
        return []
    return [(int(f[0]), int(f[2])) for f in (line.split() for line in lines) if len(f) == 3]


def _drop_to() -> tuple[int, int] | None:
    """(uid, gid) the code runs as when qerl runs as root: one of its own per call where the namespace maps it,
    else ``nobody``. None when not root (a user namespace, or nothing, stands in)."""
    if os.geteuid() != 0:
        return None
    with _calls_lock:
        n = next(_calls)
    uid = UID_BASE + ((os.getpid() & 0xFFFF) << 12 | n & 0xFFF)
    if any(first <= uid < first + count for first, count in _uid_range()):
        return uid, uid
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


def ro_paths() -> list[str]:
    """What the private root shows read-only: the system's library directories and the interpreter's prefixes
    (its standard library and site-packages; never qerl's run directory or a home, unless the interpreter lives
    in one)."""
    prefixes = {sys.base_prefix, sys.prefix, sys.exec_prefix, sys.base_exec_prefix,
                str(Path(os.path.realpath(sys.executable)).parent.parent)}
    out = [p for p in SYSTEM_PATHS if os.path.lexists(p)]
    for prefix in sorted(os.path.realpath(p) for p in prefixes):
        if prefix != "/" and not any(prefix == p or prefix.startswith(p.rstrip("/") + "/") for p in out):
            out.append(prefix)
    return out


def _cgroup_base() -> Path | None:
    """The cgroup v2 directory qerl runs in, where it may make a child (root, or a delegated subtree)."""
    try:
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
        own = next((line[3:] for line in Path("/proc/self/cgroup").read_text().splitlines()
                    if line.startswith("0::")), None)
    except OSError:
        return None
    if own is None:  # no cgroup v2 hierarchy for this process
        return None
    for line in mounts:
        left, _, right = line.partition(" - ")
        if right.split()[:1] == ["cgroup2"]:
            base = Path(left.split()[4] + own.rstrip("/"))
            if os.access(base, os.W_OK) and (base / "cgroup.procs").exists():
                return base
    return None


def _make_cgroup(limits: SandboxLimits) -> Path | None:
    """A cgroup for the call: cgroup.kill ends everything in it at once; memory.max and pids.max where this
    cgroup's parent delegates those controllers."""
    base = _cgroup_base()
    if base is None:
        return None
    try:
        enabled = set((base / "cgroup.subtree_control").read_text().split())
        for ctl in {"memory", "pids"} & set((base / "cgroup.controllers").read_text().split()) - enabled:
            try:
                (base / "cgroup.subtree_control").write_text(f"+{ctl}")
            except OSError:
                pass  # a cgroup with processes of its own cannot enable controllers for its children
        path = Path(tempfile.mkdtemp(prefix="qerl-sandbox-", dir=base))
    except OSError:
        return None
    for name, value in (("memory.max", (limits.memory_mb + limits.scratch_mb) << 20), ("memory.swap.max", 0),
                        ("pids.max", limits.processes + 2)):
        if (path / name).exists():
            try:
                (path / name).write_text(str(value))
            except OSError:
                pass
    return path


def _end_cgroup(path: Path | None) -> bool:
    """Kill what is in the call's cgroup and remove it; True when the kernel killed something for memory."""
    if path is None:
        return False
    oom = False
    try:
        events = (path / "memory.events").read_text() if (path / "memory.events").exists() else ""
        oom = any(line.split() and line.split()[0] == "oom_kill" and line.split()[1] != "0"
                  for line in events.splitlines())
        if (path / "cgroup.kill").exists():
            (path / "cgroup.kill").write_text("1")
        else:
            for pid in (path / "cgroup.procs").read_text().split():
                _kill(int(pid))
    except OSError:
        pass
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        try:
            path.rmdir()
            break
        except OSError:
            time.sleep(0.01)
    return oom


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def survivors(sid: int, uid: int | None = None, pidns: str | None = None) -> list[int]:
    """Live processes of a call: in its session, under its own uid, or in its PID namespace."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if fields[0] in "ZX":
                continue
            mine = int(fields[3]) == sid
            if not mine and uid is not None:
                status = (entry / "status").read_text()
                mine = int(status.split("\nUid:", 1)[1].split()[0]) == uid
            if not mine and pidns is not None:
                mine = os.readlink(entry / "ns" / "pid") == pidns
        except (OSError, IndexError, ValueError):
            continue
        if mine:
            out.append(int(entry.name))
    return out


def _finish(sid: int, uid: int | None, pidns: str | None) -> int:
    """Kill what is left of a call until nothing is (a PID namespace or a cgroup leaves nothing: this is the check,
    and the only kill where neither holds); returns how many processes it found."""
    found = set()
    deadline = time.monotonic() + 2.0
    while True:
        left = survivors(sid, uid, pidns)
        if not left or time.monotonic() > deadline:
            return len(found)
        found.update(left)
        for pid in left:
            _kill(pid)
        time.sleep(0.01)


def _config(limits: SandboxLimits, drop: tuple[int, int] | None, root: Path, cgroup: Path | None,
            status_fd: int) -> dict:
    mb = 1 << 20
    caps = [("RLIMIT_CPU", limits.cpu_s, limits.cpu_s + 1), ("RLIMIT_AS", limits.memory_mb * mb, limits.memory_mb * mb),
            ("RLIMIT_FSIZE", limits.file_mb * mb, limits.file_mb * mb),
            ("RLIMIT_NOFILE", limits.open_files, limits.open_files), ("RLIMIT_CORE", 0, 0)]
    if drop is not None:
        nproc: int | None = limits.processes
    else:  # in a user namespace the count starts at the namespace's own processes; this is the bound without one
        now = user_tasks(os.getuid())
        nproc = None if now is None else now + limits.processes
    return {"limits": caps, "uid": drop[0] if drop else None, "gid": drop[1] if drop else None, "nproc": nproc,
            "preload": PRELOAD, "cpu_s": limits.cpu_s, "scratch_mb": limits.scratch_mb, "ro_paths": ro_paths(),
            "main": str(root / "main.py"), "work": str(root / "work"), "newroot": str(root / "newroot"),
            "cgroup": str(cgroup) if cgroup else None, "status_fd": status_fd, "namespaces": NAMESPACES,
            "landlock": True}


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


def _read_status(fd: int) -> dict:
    """The records the monitor, init and code wrote on the status pipe, merged (later ones win)."""
    os.set_blocking(fd, False)
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    record: dict = {}
    for line in b"".join(chunks).decode("utf-8", errors="replace").splitlines():
        try:
            record.update(json.loads(line))
        except ValueError:
            continue  # a record cut short by a kill
    return record


def _last_line(text: str) -> str:
    return next((line.strip() for line in reversed(text.splitlines()) if line.strip()), "")


def _explain(record: dict, timed_out: bool, oom: bool, limits: SandboxLimits, stderr: str) -> str | None:
    """The true reason the call ended: wall clock, the call's CPU total, a per-process limit, memory, a signal,
    or the exit status."""
    if timed_out:
        return f"timed out: wall-clock limit of {limits.wall_s:g} s"
    if record.get("reason") == "cpu":
        return f"killed: CPU time limit of {limits.cpu_s} s"
    status = record.get("status")
    if status is None or not record.get("ready"):
        return "sandbox failed: " + (_last_line(stderr) or "no status from the sandboxed process")
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and record.get("code_cpu_s", 0.0) >= limits.cpu_s - 0.05):
            return f"killed: CPU time limit of {limits.cpu_s} s"
        if sig == signal.SIGKILL and oom:
            return f"killed: memory limit of {limits.memory_mb + limits.scratch_mb} MB (memory and scratch)"
        if sig == signal.SIGXFSZ:
            return f"killed: file size limit of {limits.file_mb} MB"
        return f"killed by signal {signal.Signals(sig).name}"
    code = os.WEXITSTATUS(status)
    if code == 0:
        return None
    last = _last_line(stderr)
    if last.startswith("MemoryError"):
        last += f" (memory limit of {limits.memory_mb} MB)"
    elif "[Errno 28]" in last:
        last += f" (scratch limit of {limits.scratch_mb} MB)"
    return f"exit code {code}" + (f": {last}" if last else "")


def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run ``code`` as ``__main__`` in a fresh sandbox and return what it printed, how it ended and what isolation
    held; nothing the code started outlives the call."""
    limits = limits or SandboxLimits()
    limits.check()
    drop = _drop_to()
    root = Path(tempfile.mkdtemp(prefix="qerl-sandbox-"))
    cgroup = _make_cgroup(limits)
    read_fd, write_fd = os.pipe()
    pid, record, timed_out, oom, found = -1, {}, False, False, 0
    try:
        work = root / "work"
        work.mkdir(mode=0o700)
        (root / "newroot").mkdir()
        (root / "main.py").write_text(code, encoding="utf-8")
        if drop is not None:
            os.chmod(root, 0o711)  # without a private root the code reaches its directory through this one
            os.chown(work, *drop)
        env = dict(_BASE_ENV, HOME=str(work), TMPDIR=str(work))
        args = [sys.executable, "-I", "-B", "-u", str(CHILD), json.dumps(_config(limits, drop, root, cgroup, write_fd))]
        t0 = time.perf_counter()
        with open(root / "stdout", "wb") as out, open(root / "stderr", "wb") as err:
            proc = subprocess.Popen(args, cwd=root, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    start_new_session=True, close_fds=True, pass_fds=(write_fd,))
        os.close(write_fd)
        write_fd = -1
        pid = proc.pid
        try:
            proc.wait(timeout=limits.wall_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            _kill_group(pid)  # the monitor and the init: the init's end kills its whole PID namespace
            proc.wait()
            oom = _end_cgroup(cgroup)
        seconds = time.perf_counter() - t0
        record = _read_status(read_fd)
        found = _finish(pid, drop[0] if drop and drop[0] != NOBODY else None, record.get("pidns"))
        stdout, cut_out = _head(root / "stdout", limits.output_chars)
        stderr, cut_err = _tail(root / "stderr", limits.output_chars)
        error = _explain(record, timed_out, oom, limits, stderr)
        if found:
            error = (error + "; " if error else "") + f"sandbox: {found} processes outlived the call and were killed"
        exit_code = None if timed_out or "status" not in record else os.waitstatus_to_exitcode(record["status"])
        return SandboxResult(stdout=stdout, stderr=stderr, exit_code=exit_code, error=error,
                             truncated=cut_out or cut_err, seconds=seconds, pid=pid,
                             layers=tuple(record.get("layers", ())), survivors=found,
                             cpu_s=record.get("call_cpu_s"))
    finally:
        os.close(read_fd)
        if write_fd >= 0:
            os.close(write_fd)
        if pid < 0:
            _end_cgroup(cgroup)
        shutil.rmtree(root, ignore_errors=True)


_capabilities: tuple[str, ...] | None = None


def capabilities() -> tuple[str, ...]:
    """The isolation layers that hold on this kernel, for this user (the layers of a call that printed nothing)."""
    global _capabilities
    if _capabilities is None:
        _capabilities = run_python("", SandboxLimits(wall_s=30.0)).layers
    return _capabilities
