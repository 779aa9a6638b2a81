"""The child side of the Python sandbox (tools/sandbox.py): run as ``python -I -B -u sandbox_child.py CONFIG``.

Standard library only, and nothing of qerl: it is a script, not an import. Three roles, one process each:

* the **monitor** (the process qerl started, in its own session): joins the call's cgroup, unshares the namespaces
  (a user namespace first when not root), builds the new root's read-only binds and size-limited tmpfs, and forks
* the **init**: pid 1 of the new PID namespace (so when it ends, the kernel kills every process of the call), mounts
  its /proc, pivots into the new root, forks the code, reaps everything, totals the CPU time of every process of the
  call, and kills them all when the code ends or that total passes the limit;
* the **code**: rlimits, a separate uid (or, in a user namespace, no capabilities), no_new_privs, not dumpable,
  landlock, then the model's program as ``__main__``.

Without a PID namespace the monitor is the init as well (a child subreaper, so orphans stay its descendants).
Every layer that held is recorded under "layers" on the status pipe; one that could not be set up is skipped
(the parent reports what held), never fatal, except where the code could then run with more than it should.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import time
import traceback

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP = 1, 4, 24
PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS, PR_SET_CHILD_SUBREAPER = 28, 38, 36
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
SYS_LANDLOCK = (444, 445, 446)  # create_ruleset, add_rule, restrict_self: one number on every architecture
TICK = os.sysconf("SC_CLK_TCK")
POLL_S = 0.02

libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
libc.syscall.restype = ctypes.c_long


def _check(ret: int, what: str) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def _b(s: str | None) -> bytes | None:
    return None if s is None else s.encode()


def mount(src: str | None, dst: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(libc.mount(_b(src), _b(dst), _b(fstype), flags, _b(data)), f"mount {dst}")


def prctl(option: int, arg: int) -> int:
    return libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0)


# --- the monitor: namespaces and the new root ---------------------------------------------------------------------


def unshare(cfg: dict, layers: list[str]) -> int:
    """Unshare what this kernel and privilege allow; returns the flags that held (the ladder: all at once, else
    one by one, so a kernel without network namespaces still gets the PID and mount ones)."""
    wanted = [(CLONE_NEWPID, "pid-namespace"), (CLONE_NEWNS, "mount-namespace"), (CLONE_NEWNET, "network-namespace"),
              (CLONE_NEWIPC, "ipc-namespace"), (CLONE_NEWUTS, "uts-namespace")]
    base = 0
    if os.geteuid() != 0:
        uid, gid = os.getuid(), os.getgid()
        if libc.unshare(CLONE_NEWUSER) != 0:
            return 0  # no user namespace: nothing else can be unshared without privilege
        with open("/proc/self/setgroups", "w") as f:
            f.write("deny")
        with open("/proc/self/uid_map", "w") as f:
            f.write(f"0 {uid} 1")
        with open("/proc/self/gid_map", "w") as f:
            f.write(f"0 {gid} 1")
        layers.append("user-namespace")
        base = CLONE_NEWUSER
    if libc.unshare(sum(flag for flag, _ in wanted)) == 0:
        layers.extend(name for _, name in wanted)
        return base | sum(flag for flag, _ in wanted)
    held = base
    for flag, name in wanted:
        if libc.unshare(flag) == 0:
            layers.append(name)
            held |= flag
    return held


def _ro_flags(path: str) -> int:
    """The flags a read-only remount must keep: in a user namespace the source's nosuid/nodev/noexec are locked."""
    st = os.statvfs(path)
    flags = MS_RDONLY | MS_NOSUID | MS_NODEV
    if st.f_flag & os.ST_NOEXEC:
        flags |= MS_NOEXEC
    return flags


def bind_ro(src: str, dst: str) -> None:
    if os.path.isdir(src):
        os.makedirs(dst, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        open(dst, "a").close()
    mount(src, dst, None, MS_BIND | MS_REC)
    mount(None, dst, None, MS_BIND | MS_REMOUNT | _ro_flags(src))


def build_root(cfg: dict) -> None:
    """The new root (a small tmpfs, read-only once built): the system and interpreter directories bound read-only,
    a few device nodes, and one tmpfs of ``scratch_mb`` for /tmp, /dev/shm and the working directory."""
    new = cfg["newroot"]
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,mode=755")
    for path in cfg["ro_paths"]:
        if not os.path.lexists(path):
            continue
        dst = new + path
        if os.path.islink(path) and os.path.dirname(path) == "/":  # merged /usr: /bin -> usr/bin
            os.symlink(os.readlink(path), dst)
            continue
        bind_ro(os.path.realpath(path), dst)
    os.makedirs(new + "/dev", exist_ok=True)
    for node in ("null", "zero", "full", "random", "urandom"):
        open(f"{new}/dev/{node}", "a").close()
        mount(f"/dev/{node}", f"{new}/dev/{node}", None, MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{new}/dev/{name}")
    os.makedirs(new + "/proc", exist_ok=True)
    os.makedirs(new + "/tmp", exist_ok=True)
    mount("tmpfs", new + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={cfg['scratch_mb']}m,mode=1777")
    os.makedirs(new + "/tmp/.shm", mode=0o1777)
    os.chmod(new + "/tmp/.shm", 0o1777)  # past the umask
    os.makedirs(new + "/dev/shm")
    mount(new + "/tmp/.shm", new + "/dev/shm", None, MS_BIND)  # /dev/shm shares the scratch tmpfs's size
    work = new + "/tmp/work"
    os.makedirs(work, mode=0o700)
    with open(work + "/main.py", "w", encoding="utf-8") as f:
        f.write(cfg["code"])
    if cfg["uid"] is not None:
        os.chown(work, cfg["uid"], cfg["gid"])
        os.chown(work + "/main.py", cfg["uid"], cfg["gid"])


def enter_root(cfg: dict) -> None:
    """In the init: /proc of the new PID namespace (mounted while the old root is still visible, which a user
    namespace requires), then pivot_root, and the old root detached so nothing of it stays reachable."""
    new = cfg["newroot"]
    mount("proc", new + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.chdir(new)
    nr = SYS_PIVOT_ROOT.get(os.uname().machine)
    if nr is None:
        raise OSError("pivot_root: unknown architecture")
    _check(libc.syscall(nr, b".", b"."), "pivot_root")
    _check(libc.umount2(b".", MNT_DETACH), "umount old root")
    os.chdir("/")
    mount(None, "/", None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


# --- the code process: privileges and landlock --------------------------------------------------------------------


def drop_privileges(cfg: dict, layers: list[str]) -> None:
    if cfg["uid"] is not None:  # root: a uid of its own (no file of the system is its, RLIMIT_NPROC binds it)
        os.setgroups([])
        os.setresgid(cfg["gid"], cfg["gid"], cfg["gid"])
        os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])  # clears every capability
        layers.append(f"uid-{cfg['uid']}")
    elif "user-namespace" in layers:  # root of a user namespace: give up its capabilities for good
        prctl(PR_SET_SECUREBITS, 0x2F)  # NOROOT, NO_SETUID_FIXUP, KEEP_CAPS_LOCKED and their locks
        for cap in range(64):
            prctl(PR_CAPBSET_DROP, cap)

        class Head(ctypes.Structure):
            _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

        _check(libc.capset(ctypes.byref(Head(0x20080522, 0)), (ctypes.c_uint32 * 6)()), "capset")
        layers.append("no-capabilities")
    _check(prctl(PR_SET_NO_NEW_PRIVS, 1), "no_new_privs")
    prctl(PR_SET_DUMPABLE, 0)
    layers.append("no-new-privs")


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def landlock(read: list[str], write: list[str], files_rw: list[str], layers: list[str]) -> None:
    """Landlock: reads beneath ``read``, writes beneath ``write`` only; by ABI version also no TCP bind/connect (4),
    no signals to and no abstract sockets of processes outside the sandbox (6). It also keeps ptrace and
    /proc/<pid>/mem of any process outside the sandbox out of reach (every ABI)."""
    abi = libc.syscall(SYS_LANDLOCK[0], None, 0, 1)
    if abi < 1:
        return
    every = (1 << 13) - 1 | (1 << 13 if abi >= 2 else 0) | (1 << 14 if abi >= 3 else 0) | (1 << 15 if abi >= 5 else 0)
    rx = 1 | 4 | 8  # execute, read file, read dir
    file_rw = 2 | 4 | (1 << 14 if abi >= 3 else 0) | (1 << 15 if abi >= 5 else 0)
    attr = (ctypes.c_uint64 * 3)(every, 1 | 2 if abi >= 4 else 0, 1 | 2 if abi >= 6 else 0)
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8
    fd = _check(libc.syscall(SYS_LANDLOCK[0], ctypes.byref(attr), size, 0), "landlock_create_ruleset")
    try:
        for paths, access in ((read, rx), (write, every), (files_rw, file_rw)):
            for path in paths:
                try:
                    pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
                except OSError:
                    continue
                rule = _PathBeneath(access if os.path.isdir(path) else access & (1 | file_rw), pfd)
                try:
                    _check(libc.syscall(SYS_LANDLOCK[1], fd, 1, ctypes.byref(rule), 0), f"landlock rule {path}")
                finally:
                    os.close(pfd)
        _check(libc.syscall(SYS_LANDLOCK[2], fd, 0), "landlock_restrict_self")
    finally:
        os.close(fd)
    layers.append(f"landlock-abi{abi}")
    if abi >= 4:
        layers.append("landlock-no-tcp")
    if abi >= 6:
        layers.append("landlock-signal-scope")


def set_limits(cfg: dict) -> None:
    import resource

    for kind, soft, hard in cfg["limits"]:
        resource.setrlimit(getattr(resource, kind), (soft, hard))
    if cfg["nproc"] is not None:
        resource.setrlimit(resource.RLIMIT_NPROC, (cfg["nproc"], cfg["nproc"]))


def _exit_status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def run_code(cfg: dict, layers: list[str], mounted: bool) -> None:
    """The code process: never returns."""
    status = 1
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # the init's SIG_DFL, back to Python's own
        work = "/tmp/work" if mounted else cfg["work"]
        os.chdir(work)
        os.environ["HOME"] = os.environ["TMPDIR"] = work
        set_limits(cfg)
        drop_privileges(cfg, layers)
        if cfg["landlock"]:
            if mounted:
                read, write = ["/"], ["/tmp", "/dev/shm"]  # all the private root shows may be read
            else:
                read, write = [*cfg["ro_paths"], "/proc"], [work]
            landlock([p for p in read if os.path.exists(p)], write, ["/dev/null", "/dev/zero", "/dev/full",
                                                                     "/dev/random", "/dev/urandom"], layers)
        with open("main.py", encoding="utf-8") as f:
            src = f.read()
        report(cfg, {"layers": layers, "ready": True})  # what holds for the code itself: the last word
        os.close(cfg["status_fd"])
    except BaseException:
        traceback.print_exc()
        os._exit(125)  # the sandbox could not be set up: never run the code with less isolation than reported
    sys.argv = ["main.py"]
    try:
        exec(compile(src, "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        status = 0
    except SystemExit as e:
        status = _exit_status(e.code)
    except BaseException as e:
        traceback.print_exception(type(e), e, e.__traceback__.tb_next if e.__traceback__ else None)
        status = 1
    try:  # what a normal interpreter exit does: wait for threads, run atexit, flush
        import atexit
        import threading

        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        pass
    os._exit(status)


# --- the init: reap, total the CPU time, kill everything at the end ------------------------------------------------


def _procs() -> dict[int, tuple[int, float]]:
    """pid -> (ppid, CPU seconds of it and of its reaped children) for every process /proc shows."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(name)] = (int(fields[1]), sum(int(x) for x in fields[11:15]) / TICK)
    return out


def _descendants(procs: dict[int, tuple[int, float]], root: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for pid, (ppid, _) in procs.items():
        kids.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        for child in kids.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _kill_all(in_pidns: bool) -> None:
    """SIGKILL every process of the call and reap them: kill(-1) in a PID namespace reaches exactly those; without
    one, the descendants of this subreaper, again until none is left (a fork may race the scan)."""
    for _ in range(200):
        if in_pidns:
            try:
                os.kill(-1, signal.SIGKILL)
            except ProcessLookupError:
                pass
        else:
            for pid in _descendants(_procs(), os.getpid()):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            return
        time.sleep(0.005)


def supervise(cfg: dict, layers: list[str], mounted: bool, in_pidns: bool) -> dict:
    """Fork the code, wait for it while totalling the CPU time of every process of the call; kill them all at the
    end. Returns the code's wait status and why it ended."""
    import resource

    pid = os.fork()
    if pid == 0:
        run_code(cfg, layers, mounted)
    status, reason, own_cpu, total = None, None, 0.0, 0.0
    while status is None:
        time.sleep(POLL_S)
        while True:
            try:
                got, st, ru = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                got = 0
            if got == 0:
                break
            if got == pid:
                status, own_cpu = st, ru.ru_utime + ru.ru_stime
        if status is None:
            reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
            procs = _procs()
            me = os.getpid()
            live = sum(procs[p][1] for p in _descendants(procs, me) if p in procs)
            total = reaped.ru_utime + reaped.ru_stime + live
            if total >= cfg["cpu_s"]:
                reason = "cpu"
                os.kill(pid, signal.SIGKILL)
    _kill_all(in_pidns)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    # /proc counts in clock ticks, rusage exactly: the larger of the two totals the limit was checked against
    return {"status": status, "reason": reason, "code_cpu_s": own_cpu,
            "call_cpu_s": max(total, reaped.ru_utime + reaped.ru_stime)}


def report(cfg: dict, record: dict) -> None:
    os.write(cfg["status_fd"], (json.dumps(record) + "\n").encode())


def main() -> None:
    cfg = json.loads(sys.argv[1])
    with open(cfg["main"], encoding="utf-8") as f:
        cfg["code"] = f.read()
    layers = ["session"]
    for name in cfg["preload"]:  # imported now: the code may not be able to read the interpreter's files later
        try:
            __import__(name)
        except ImportError:
            pass
    if cfg["cgroup"]:
        try:
            with open(os.path.join(cfg["cgroup"], "cgroup.procs"), "w") as f:
                f.write("0")
            layers.append("cgroup")
        except OSError:
            pass
    flags = unshare(cfg, layers) if cfg["namespaces"] else 0
    mounted = False
    if flags & CLONE_NEWNS:
        try:
            build_root(cfg)
            mounted = True
        except OSError as e:
            print(f"sandbox: no private root ({e}); the host's files stay visible", file=sys.stderr)
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    if not flags & CLONE_NEWPID:
        if not mounted:
            with open(os.path.join(cfg["work"], "main.py"), "w", encoding="utf-8") as f:
                f.write(cfg["code"])
        report(cfg, {"layers": layers})
        record = supervise(cfg, layers, False, False)
        report(cfg, record)
        os._exit(0)
    init = os.fork()
    if init == 0:  # pid 1 of the call's PID namespace
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the monitor killed (wall clock): the namespace dies with it
        prctl(PR_SET_DUMPABLE, 0)
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # no handler: a pid 1 ignores what its namespace sends it
        try:
            if mounted:
                enter_root(cfg)
                layers.append("private-root")
            else:
                raise OSError("no private root")
        except OSError:
            if mounted:
                traceback.print_exc()
                os._exit(125)  # the mounts are half made: do not run the code
            try:  # a /proc of this namespace at least, so /proc/<pid> of qerl is not there to read
                if not flags & CLONE_NEWNS:
                    raise OSError("no mount namespace")
                mount(None, "/", None, MS_REC | MS_PRIVATE)
                mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
                layers.append("private-proc")
            except OSError:
                pass
            with open(os.path.join(cfg["work"], "main.py"), "w", encoding="utf-8") as f:
                f.write(cfg["code"])
        report(cfg, {"layers": layers, "pidns": os.readlink("/proc/self/ns/pid")})
        report(cfg, supervise(cfg, layers, mounted, True))
        os._exit(0)
    while True:
        try:
            os.waitpid(init, 0)
            break
        except InterruptedError:
            continue
    os._exit(0)


if __name__ == "__main__":
    main()
