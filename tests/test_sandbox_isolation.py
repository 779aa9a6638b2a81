"""The sandbox holds against the payloads of a security tour (docs/tools.md, "What the Python sandbox isolates"):
each test runs one attack as model-written code and checks, from outside, that it failed. A test whose layer this
kernel or user does not give is skipped with the reason; the layers that held come back with every call."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import pytest

from qerl_cli.tools import sandbox
from qerl_cli.tools.sandbox import SandboxLimits, capabilities, run_python, survivors

LIMITS = SandboxLimits(cpu_s=1, wall_s=10.0, memory_mb=256, processes=8, output_chars=2000, scratch_mb=16)
SECRET = "qerl-test-secret-7f3a"


def layers() -> tuple[str, ...]:
    return capabilities()


def needs(*any_of: str) -> pytest.MarkDecorator:
    """Skip unless one of the layers (or a layer starting with it, for "uid-" and "landlock-") held here."""
    have = layers()
    ok = any(any(layer == want or layer.startswith(want) for layer in have) for want in any_of)
    return pytest.mark.skipif(not ok, reason=f"needs one of {any_of}; this kernel and user give {have}")


def by_comm(name: str) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "comm").read_text().strip() == name:
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state not in "ZX":
                    out.append(int(entry.name))
        except OSError:
            continue
    return out


def test_layers_are_reported_and_known() -> None:
    known = {"session", "cgroup", "user-namespace", "pid-namespace", "mount-namespace", "network-namespace",
             "ipc-namespace", "uts-namespace", "private-root", "private-proc", "no-capabilities", "no-new-privs",
             "landlock-no-tcp", "landlock-signal-scope"}
    got = layers()
    assert "session" in got and "no-new-privs" in got
    assert all(layer in known or layer.startswith(("uid-", "landlock-abi")) for layer in got), got
    if os.geteuid() == 0:  # root always gets a uid that is not root's
        assert any(layer.startswith("uid-") and layer != "uid-0" for layer in got)


def test_the_parents_environment_and_memory_are_out_of_reach(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QERL_TEST_SECRET", SECRET)
    code = f"""
import ctypes, os
found, tried = [], []
print(os.environ.get("QERL_TEST_SECRET"))
for pid in {{os.getppid(), {os.getpid()}, *[int(p) for p in os.listdir("/proc") if p.isdigit()]}}:
    for name in ("environ", "mem", "cmdline"):
        try:
            with open(f"/proc/{{pid}}/{{name}}", "rb") as f:
                if name == "mem":
                    f.seek(0x400000)
                data = f.read(1 << 20)
            if b"{SECRET}" in data:
                found.append((pid, name))
        except OSError as e:
            tried.append(type(e).__name__)
libc = ctypes.CDLL(None, use_errno=True)
print("found", found)
print("ptrace", libc.ptrace(16, {os.getpid()}, 0, 0), libc.ptrace(16, os.getppid(), 0, 0))  # PTRACE_ATTACH
"""
    res = run_python(code, LIMITS)
    assert res.error is None, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == "None" and lines[1] == "found []" and lines[2] == "ptrace -1 -1"
    assert SECRET not in res.stdout + res.stderr


def test_the_run_directory_and_home_are_not_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run, home = tmp_path / "run", tmp_path / "home"
    for d in (run, home):
        d.mkdir()
        d.chmod(0o777)  # world-writable: only the sandbox can keep the code out
    weights = run / "model.safetensors"
    weights.write_bytes(b"weights")
    weights.chmod(0o666)
    monkeypatch.setenv("HOME", str(home))
    code = f"""
import os
for path in ({str(weights)!r}, {str(run / 'new.txt')!r}, {str(home / '.bashrc')!r},
             os.path.expanduser("~/.profile"), "/root/.bashrc"):
    try:
        with open(path, "wb") as f:
            f.write(b"owned")
        print("wrote", path)
    except OSError as e:
        print("refused", type(e).__name__)
"""
    res = run_python(code, LIMITS)
    assert res.error is None, res.stderr
    lines = res.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["refused", "refused", "refused", "wrote", "refused"], lines
    assert str(tmp_path) not in lines[3]  # ~ is the call's own scratch directory, not $HOME
    assert weights.read_bytes() == b"weights"
    assert sorted(p.name for p in run.iterdir()) == ["model.safetensors"] and list(home.iterdir()) == []


@needs("pid-namespace", "landlock-signal-scope", "uid-")
def test_the_code_cannot_kill_qerl() -> None:
    code = f"""
import os, signal
for pid in (os.getppid(), {os.getpid()}):
    try:
        os.kill(pid, signal.SIGKILL)
        print("killed", pid)
    except OSError as e:
        print("refused", type(e).__name__)
for p in os.listdir("/proc"):  # kill -9 of every process /proc shows, qerl's among them where it shows
    if p.isdigit() and int(p) != os.getpid():
        try:
            os.kill(int(p), signal.SIGKILL)
        except OSError:
            pass
try:
    os.kill(-1, signal.SIGKILL)
except OSError:
    pass
print("done")
"""
    res = run_python(code, LIMITS)
    # pid 0 (the parent outside the PID namespace) would signal the code's own group: the call may end killed
    assert "killed " + str(os.getpid()) not in res.stdout
    assert run_python("print(6 * 7)", LIMITS).stdout == "42\n"  # qerl (this test) is alive and still runs calls


def test_a_setsid_daemon_does_not_outlive_the_call() -> None:
    code = """
import ctypes, os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        ctypes.CDLL(None).prctl(15, b"qerl-daemon-x", 0, 0, 0)  # PR_SET_NAME: the test finds it by name
        for d in ("/tmp", "/dev/shm", os.getcwd()):
            try:
                open(os.path.join(d, "sitecustomize.py"), "w").write("print('owned')")
            except OSError:
                pass
        while True:
            time.sleep(0.05)
    os._exit(0)
time.sleep(0.3)
print("left a daemon")
"""
    res = run_python(code, LIMITS)
    assert res.error is None and res.stdout == "left a daemon\n", res.stderr
    assert res.survivors == 0 and by_comm("qerl-daemon-x") == [] and survivors(res.pid) == []
    later = run_python("import os, sys\nprint(6 * 7)\nprint(sorted(os.listdir('.')))\n", LIMITS)
    assert later.stdout.splitlines() == ["42", "['main.py']"] and later.error is None


def test_a_chain_of_cpu_burners_is_limited_per_call() -> None:
    code = """
import os, time
def burn(s):
    t = time.process_time()
    while time.process_time() - t < s:
        pass
for _ in range(6):  # each process 0.4 s: under the per-process limit, past the call's 1 s together
    if os.fork() != 0:
        burn(0.4)
        os.wait()
        os._exit(0)
burn(0.4)
"""
    t0 = time.monotonic()
    res = run_python(code, SandboxLimits(cpu_s=1, wall_s=20.0, processes=16))
    assert res.error == "killed: CPU time limit of 1 s", (res.error, res.stderr)
    assert res.cpu_s is not None and 1.0 <= res.cpu_s < 1.6  # the call's total, not 7 x 0.4 s
    assert time.monotonic() - t0 < 15.0 and res.survivors == 0


@needs("private-root")
def test_tmp_and_dev_shm_fillers_stop_at_the_scratch_limit_and_nothing_persists() -> None:
    code = """
import os
written = 0
try:
    with open("/dev/shm/fill", "wb") as f:
        for _ in range(64):
            f.write(b"0" * (1 << 20))
            f.flush()
            written += 1
except OSError as e:
    print("stopped", written, e.errno)
try:
    open("/tmp/persist", "w").write("x")
    print("tmp ok")
except OSError as e:
    print("tmp", e.errno)
raise OSError(28, "No space left on device")
"""
    res = run_python(code, LIMITS)
    words = res.stdout.split()
    assert words[0] == "stopped" and int(words[1]) <= LIMITS.scratch_mb and words[2] == "28"  # ENOSPC
    assert res.error == "exit code 1: OSError: [Errno 28] No space left on device (scratch limit of 16 MB)"
    assert not Path("/dev/shm/fill").exists() and not Path("/tmp/persist").exists()  # never the host's
    later = run_python("import os\nprint(sorted(os.listdir('/dev/shm')), sorted(os.listdir('/tmp')))\n", LIMITS)
    assert later.stdout == "[] ['.shm', 'work']\n"


@needs("network-namespace", "landlock-no-tcp")
def test_the_network_is_unreachable() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        code = f"""
import socket
for addr in (("127.0.0.1", {port}), ("1.1.1.1", 53)):
    try:
        socket.create_connection(addr, timeout=1).close()
        print("connected", addr)
    except OSError as e:
        print("refused", e.errno)
"""
        res = run_python(code, LIMITS)
    assert res.error is None and res.stdout.count("refused") == 2 and "connected" not in res.stdout, res.stdout


@pytest.mark.parametrize(("code", "wall_s", "want"), [
    ("while True:\n    pass\n", 10.0, "killed: CPU time limit of 1 s"),
    ("import time\ntime.sleep(30)\n", 1.5, "timed out: wall-clock limit of 1.5 s"),
    ("b = bytearray(1 << 30)\n", 10.0, "exit code 1: MemoryError (memory limit of 256 MB)"),
    # a kill that is not the CPU limit's is reported as the signal it is
    ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n", 10.0, "killed by signal SIGKILL"),
    ("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\n", 10.0, "killed by signal SIGTERM"),
    ("import sys\nsys.exit(3)\n", 10.0, "exit code 3"),
])
def test_the_reported_reason_is_the_true_one(code: str, wall_s: float, want: str) -> None:
    res = run_python(code, SandboxLimits(cpu_s=1, wall_s=wall_s, memory_mb=256, processes=8))
    assert res.error == want, (res.error, res.stderr)


def test_a_process_of_the_call_gone_astray_is_found_and_killed() -> None:
    """The parent's last check (survivors) sees what a sandbox without PID namespace or cgroup might leave."""
    import subprocess

    proc = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        assert survivors(proc.pid) == [proc.pid]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert survivors(proc.pid) == []
    finally:
        if proc.poll() is None:
            proc.kill()


def test_without_namespaces_the_fallback_layers_still_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel (or a container's seccomp) without namespaces: a uid of its own (root) or landlock, a subreaper
    and the parent's scan stand in. The daemon dies, qerl's /proc entries and signals stay out of reach."""
    monkeypatch.setattr(sandbox, "NAMESPACES", False)
    monkeypatch.setenv("QERL_TEST_SECRET", SECRET)
    probe = run_python("", LIMITS)
    if not any(layer.startswith(("uid-", "landlock-abi")) for layer in probe.layers):
        pytest.skip(f"no fallback layer holds here: {probe.layers}")
    assert "pid-namespace" not in probe.layers and "private-root" not in probe.layers
    code = f"""
import ctypes, os, time
for pid in (os.getppid(), {os.getpid()}):
    for name in ("environ", "mem"):
        try:
            print(b"{SECRET}" in open(f"/proc/{{pid}}/{{name}}", "rb").read())
        except OSError as e:
            print(type(e).__name__)
try:
    os.kill({os.getpid()}, 0)
    print("could signal")
except OSError as e:
    print(type(e).__name__)
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        ctypes.CDLL(None).prctl(15, b"qerl-daemon-f", 0, 0, 0)
        time.sleep(30)
    os._exit(0)
time.sleep(0.2)
"""
    res = run_python(code, LIMITS)
    assert res.stdout.split() == ["PermissionError"] * 5, (res.stdout, res.stderr)
    assert res.error is None and res.survivors == 0 and by_comm("qerl-daemon-f") == []
