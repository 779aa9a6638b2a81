"""Run directory and its manifest: the only state shared between stages.

`DIR/manifest.json` records, per stage, what the stage consumed and produced (paths relative to DIR,
sha256 of weight files), its config, seeds, environment, timings and status. Later stages find their
inputs through it. Every write is atomic (temp file + fsync + rename), one process at a time holds
the run's lock, and a manifest that is corrupted or from a newer schema is reported, never rewritten.

A run directory is untrusted input (users copy, share and download them): every path qerl reads from it or
writes into it goes through `RunDir.inside`, which refuses one that leads outside the run, symbolic links
included, and nothing is written through a symbolic link.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import fcntl
import hashlib
import io
import json
import math
import os
import re
import shutil
import stat
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qerl_cli.errors import OutsideRunError, QerlError, RunLockedError, StageMissingError

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
LOCK_NAME = ".lock"

# What produces each stage, for "run X first" messages.
PRODUCER = {
    "quantize": "qerl quantize --run DIR",
    "train": "qerl train --run DIR",
}


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _disk_error(path: Path, exc: OSError) -> QerlError:
    where = Path(path).parent
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        full = "out of disk space" if exc.errno == errno.ENOSPC else "over the disk quota"
        return QerlError(f"{full} while writing {path}: free space on {where} and run the command again")
    if exc.errno == errno.EFBIG:
        return QerlError(f"{path} grew past the largest file this process may write (`ulimit -f` or the file "
                         f"system's limit): raise the limit or use another file system, and run the command again")
    if exc.errno == errno.EROFS:
        return QerlError(f"{where} is on a read-only file system, so {path} could not be written: make it writable "
                         "or use another --run directory")
    if exc.errno == errno.EIO:
        return QerlError(f"I/O error while writing {path}: check the disk (or network file system) under {where} "
                         "and run the command again")
    return QerlError(f"could not write {path}: {exc.strerror or exc}")


_OS_ERROR_RE = re.compile(r"os error (\d+)")


def write_error(path: Path, exc: BaseException) -> QerlError | None:
    """The one line for a failed write of ``path``: an OSError, or a library error that wraps one (safetensors'
    SafetensorError says "... (os error 28)"); None for anything else (a bug, not the disk)."""
    if isinstance(exc, QerlError):
        return None
    if isinstance(exc, OSError):
        return _disk_error(path, exc)
    found = _OS_ERROR_RE.search(str(exc)) if type(exc).__name__ == "SafetensorError" else None
    if found is None:
        return None
    code = int(found.group(1))
    return _disk_error(path, OSError(code, os.strerror(code)))


@contextlib.contextmanager
def write_errors(path: Path) -> Iterator[None]:
    """Around a write of ``path``: a full disk, a quota, a read-only or failing file system is one QerlError line
    naming the path and what to do, never a traceback."""
    try:
        yield
    except Exception as exc:
        err = write_error(path, exc)
        if err is None:
            raise
        raise err from exc


def jsonable(obj: Any) -> Any:
    """Plain JSON data: dict keys as strings, tuples as lists, NaN/inf as null (strict JSON has neither)."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that readers see either the old file or the whole new one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()  # a leftover (or a planted link) goes; the new file is created, never opened through a link
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise _disk_error(path, exc) from exc
    _fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def atomic_write_png(path: Path, fig: Any, dpi: int = 110) -> None:
    """Render a matplotlib figure to PNG and write it atomically (a killed bench leaves no half plot)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    atomic_write_bytes(path, buf.getvalue())


def open_regular(path: str | os.PathLike[str]) -> io.BufferedReader:
    """``path`` opened for reading, refused in one line unless it is a regular file: a FIFO (or a device) where a
    JSON or weight file belongs would block the reader forever. Opened without blocking, so the check comes before
    any read can wait; a missing file raises FileNotFoundError as `open` would."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise QerlError(f"cannot read {path}: {exc.strerror or exc}: restore it, or use another directory") from exc
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        what = "a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode) else "not a regular file"
        raise QerlError(f"{path} is {what}, not a regular file: qerl reads only regular files there; replace it "
                        "with the file it should be, or move it aside")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def read_regular(path: str | os.PathLike[str]) -> bytes:
    """The bytes of ``path``, a regular file (:func:`open_regular`); a failed read is one line."""
    with open_regular(path) as f:
        try:
            return f.read()
        except OSError as exc:
            raise QerlError(f"cannot read {path}: {exc.strerror or exc}: restore it, or use another directory") \
                from exc


def read_regular_text(path: str | os.PathLike[str]) -> str:
    """:func:`read_regular` decoded as UTF-8 (an undecodable byte raises UnicodeDecodeError, like `read_text`)."""
    return read_regular(path).decode("utf-8")


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open_regular(path) as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def staged_directory(final: Path) -> Iterator[Path]:
    """Yield a temporary sibling directory; on success it replaces `final` in one rename.

    On any failure (Ctrl-C, full disk) the temporary directory is removed and `final` is untouched,
    so a later stage never trusts a half-written output.
    """
    final = Path(final)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    if tmp.is_symlink():
        tmp.unlink()  # rmtree refuses a link, and the staging directory must be a real one
    elif tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        _fsync_dir(tmp)
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
        if old.exists():
            shutil.rmtree(old, ignore_errors=True)
        _fsync_dir(final.parent)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        err = write_error(final, exc)
        if err is not None:
            raise err from exc
        raise


# atomic_write_bytes', staged_directory's and RunDir.stage's (its manifest reserve) names
_STAGING_RE = re.compile(r"^\..+\.(?:tmp|old|reserve)-(\d+)$")
# Disk space a stage sets aside while it runs, besides twice the manifest's size: what writing its last record takes
# when something filled the disk meanwhile (the record says why the stage failed instead of staying "running").
MANIFEST_RESERVE_BYTES = 1 << 16


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_staging(root: Path) -> list[Path]:
    """Remove the staging files and directories (``.NAME.tmp-PID``, ``.NAME.old-PID``) under ``root`` that a killed
    writer left: a SIGKILL skips the cleanup of :func:`atomic_write_bytes` and :func:`staged_directory`. Those of a
    live process (this one's included) are left alone, since it may still be writing them. The removed paths."""
    removed = []
    for parent, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            found = _STAGING_RE.match(name)
            if found is None or int(found.group(1)) == os.getpid() or _pid_alive(int(found.group(1))):
                continue
            path = Path(parent) / name
            if name in dirs:
                dirs.remove(name)  # not walked into: it goes whole
            if name in files or path.is_symlink():  # a link goes, never what it points to
                with contextlib.suppress(OSError):
                    path.unlink()
            else:
                shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _release(path: Path | None) -> None:
    if path is not None:
        with contextlib.suppress(OSError):
            path.unlink()


@dataclass
class StageRecord:
    """One stage's entry in the manifest; mutate `outputs`, `metrics` and `extra` inside `RunDir.stage`."""

    stage: str
    key: str
    config: dict[str, Any] = field(default_factory=dict)
    inputs: dict[str, Any] = field(default_factory=dict)
    outputs: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    seeds: dict[str, Any] = field(default_factory=dict)
    status: str = "running"
    started: str = field(default_factory=now_iso)
    finished: str | None = None
    duration_s: float | None = None
    env: dict[str, Any] = field(default_factory=dict)
    pid: int = field(default_factory=os.getpid)
    error: str | None = None
    attempt: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    # not written to the manifest: while True, a QerlError that ends the stage is a refusal, and the manifest gets
    # back exactly what it held before the stage began; a stage sets it False once it starts changing its outputs
    refusable: bool = field(default=True, repr=False, compare=False)
    # not written either: while True, a stage that fails or is interrupted leaves the earlier completed record of its
    # key in place (its attempt goes into the history only), for a stage that redoes outputs it has not yet replaced
    keeps_earlier: bool = field(default=False, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("refusable", "keeps_earlier")}


def run_path(path: str | os.PathLike[str]) -> Path:
    """The path a `--run` names, ``~`` expanded; an empty one is refused (``Path("")`` is the current directory,
    which the user did not mean to fill with a run)."""
    if not str(path).strip():
        raise QerlError("--run is empty: give the run directory, e.g. --run runs/demo")
    return Path(path).expanduser()


class RunDir:
    """A run directory. Construct, then use `with run.lock():` around any writing stage."""

    def __init__(self, path: str | os.PathLike[str], create: bool = True) -> None:
        # absolute from here on: `inside` reads a relative path as relative to the run, so a relative run path
        # (`--run runs/demo`) joined into `run.path / "eval"` would be taken relative to the run a second time
        self.path = run_path(path).absolute()
        if self.path.exists() and not self.path.is_dir():
            raise QerlError(f"run directory {self.path} is a file, not a directory: pick another --run path")
        if not self.path.exists():
            if not create:
                raise QerlError(f"run directory {self.path} does not exist: run `qerl quantize --run {path}` first")
            try:
                self.path.mkdir(parents=True)
            except OSError as exc:
                raise QerlError(f"cannot create run directory {self.path}: {exc.strerror or exc}") from exc
        self.root = self.path.resolve()  # the real directory; the --run path itself may be a link
        self._lock_fd: int | None = None

    @property
    def manifest_path(self) -> Path:
        return self.path / MANIFEST_NAME

    def rel(self, p: str | os.PathLike[str]) -> str:
        return os.path.relpath(Path(p), self.path)

    def abs(self, rel: Any, entry: str = "") -> Path:
        """A path the manifest records (relative to the run), confined to the run (:meth:`inside`); ``entry``
        names the manifest entry in a refusal."""
        where = f"{self.manifest_path}" + (f" ({entry})" if entry else "")
        if not isinstance(rel, str) or not rel:
            raise OutsideRunError(f"{where} holds {rel!r} where a path inside the run belongs: restore the "
                                  "manifest or use another --run directory")
        return self.inside(rel, named_by=where)

    # ---- confinement ------------------------------------------------------------------------------
    def inside(self, path: str | os.PathLike[str], *, named_by: str | os.PathLike[str] | None = None) -> Path:
        """``path`` (relative to the run, or a path under it) as a path in the run, refused with one line
        (OutsideRunError) unless it resolves inside the run directory, every symbolic link on the way followed.

        ``named_by``: the file whose content named ``path`` (a manifest entry, `latest`), for the message; without
        it the refusal names the link that leads out. A link that stays inside the run is followed."""
        rel = Path(path)
        joined = rel if rel.is_absolute() else self.path / rel
        try:
            real = joined.resolve()  # a link to a missing target still resolves to where it points
        except (OSError, RuntimeError, ValueError) as exc:  # a NUL byte, a loop of links
            raise OutsideRunError(f"{named_by or joined} names {str(path)!r}, which is not a usable path in the run "
                                  f"directory {self.path} ({exc}): restore the run directory or use another "
                                  "--run directory") from exc
        if real == self.root or self.root in real.parents:
            # without "..", the OS follows the links just checked; with it, only the resolved path is the one checked
            return self.path / real.relative_to(self.root) if ".." in rel.parts else joined
        fix = "restore the run directory or use another --run directory"
        if named_by is not None:
            raise OutsideRunError(f"{named_by} names {str(path)!r}, which leads outside the run directory "
                                  f"{self.path} (to {real}): qerl reads and writes only inside a run; {fix}")
        link = self._link_out(joined)
        if link is not None:
            raise OutsideRunError(f"{link} is a symbolic link to {os.readlink(link)}, outside the run directory "
                                  f"{self.path}: qerl reads and writes only inside a run; replace the link with "
                                  f"what it points to, or {fix}")
        raise OutsideRunError(f"{joined} leads outside the run directory {self.path} (to {real}): {fix}")

    def _link_out(self, joined: Path) -> Path | None:
        """The first symbolic link on ``joined`` (below the run) that resolves outside the run."""
        try:
            parts = joined.relative_to(self.path).parts
        except ValueError:
            return None
        cur = self.path
        for part in parts:
            cur = cur / part
            if cur.is_symlink():
                real = cur.resolve()
                if real != self.root and self.root not in real.parents:
                    return cur
        return None

    def inside_tree(self, directory: str | os.PathLike[str], *, named_by: str | os.PathLike[str] | None = None
                    ) -> Path:
        """:meth:`inside` for a directory and everything below it (a model or checkpoint folder whose files a
        library opens by name): every symbolic link in it must stay inside the run."""
        top = self.inside(directory, named_by=named_by)
        seen: set[Path] = set()
        # top-down, each link is checked before os.walk enters it; a directory reached twice is walked once
        for root, dirs, files in os.walk(top, followlinks=True):
            real = Path(root).resolve()
            if real in seen:
                dirs[:] = []
                continue
            seen.add(real)
            for name in (*dirs, *files):
                if (Path(root) / name).is_symlink():
                    self.inside(Path(root) / name)
        return top

    # ---- manifest -------------------------------------------------------------------------------
    def read(self) -> dict[str, Any]:
        if not self.manifest_path.exists():
            return {"schema_version": SCHEMA_VERSION, "created": now_iso(), "stages": {}, "history": []}
        try:
            data = json.loads(read_regular_text(self.inside(MANIFEST_NAME)))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise QerlError(
                f"{self.manifest_path} is corrupted ({exc.__class__.__name__}: {exc}); qerl will not overwrite it: "
                "restore it or move the run directory aside"
            ) from exc
        if not isinstance(data, dict) or not isinstance(data.get("schema_version"), int):
            raise QerlError(
                f"{self.manifest_path} is not a qerl manifest (no schema_version): use another --run directory"
            )
        if data["schema_version"] > SCHEMA_VERSION:
            raise QerlError(
                f"{self.manifest_path} has schema {data['schema_version']}, newer than this qerl understands "
                f"({SCHEMA_VERSION}): upgrade qerl"
            )
        data.setdefault("stages", {})
        data.setdefault("history", [])
        return data

    def _write(self, data: dict[str, Any]) -> None:
        atomic_write_json(self.manifest_path, data)

    def record(self, key: str) -> dict[str, Any] | None:
        """The latest record under `key`, with a stale 'running' shown as 'interrupted'."""
        rec = self.read()["stages"].get(key)
        if rec and rec.get("status") == "running" and not self._is_locked_by_other():
            rec = {**rec, "status": "interrupted"}
        return rec

    def require(self, key: str) -> dict[str, Any]:
        """The completed record of stage `key`, or a clear error naming the command that produces it."""
        rec = self.record(key)
        stage = key.split("/")[0]
        producer = PRODUCER.get(stage, f"qerl {stage} --run DIR").replace("DIR", str(self.path))
        if rec is None:
            raise StageMissingError(f"run directory {self.path} has no {key} stage: run `{producer}` first")
        if rec.get("status") != "completed":
            raise StageMissingError(
                f"the {key} stage in {self.path} is {rec.get('status')}, not completed: run `{producer}` again"
            )
        return rec

    # ---- lock -----------------------------------------------------------------------------------
    def _open_lock(self, create: bool) -> int | None:
        """The lock file's descriptor (None: absent and not ``create``d); a symbolic link, a hard link (a file with
        another name elsewhere) or anything but a regular file is refused, so the PID written into it never lands
        in another file."""
        path = self.path / LOCK_NAME
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | (os.O_CREAT if create else 0), 0o644)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise OutsideRunError(f"{path} is a symbolic link: qerl never writes through a link in a run "
                                      "directory; delete it (qerl creates the lock file itself)") from None
            raise QerlError(f"cannot open the run's lock file {path}: {exc.strerror or exc}") from exc
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise QerlError(f"{path} is not a regular file: delete it (qerl creates the lock file itself)")
        if st.st_nlink > 1:
            os.close(fd)
            raise OutsideRunError(f"{path} is a hard link ({st.st_nlink} names for one file): qerl would write its "
                                  "PID into the other file too; delete it (qerl creates the lock file itself)")
        return fd

    def _is_locked_by_other(self) -> bool:
        if self._lock_fd is not None:
            return False
        fd = self._open_lock(create=False)
        if fd is None:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False

    @contextlib.contextmanager
    def lock(self) -> Iterator[RunDir]:
        """Hold the run's exclusive lock; a second writer is refused at once with a clear message."""
        if self._lock_fd is not None:
            yield self
            return
        fd = self._open_lock(create=True)
        assert fd is not None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = ""
            with contextlib.suppress(OSError, ValueError):
                holder = f" (pid {int(os.pread(fd, 32, 0).decode().strip() or 0)})"
            os.close(fd)
            raise RunLockedError(
                f"another qerl process{holder} is writing {self.path}: wait for it or use another --run directory"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._lock_fd = fd
        try:
            yield self
        finally:
            self._lock_fd = None
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    # ---- stages ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def stage(
        self,
        stage: str,
        config: dict[str, Any] | None = None,
        inputs: dict[str, Any] | None = None,
        seeds: dict[str, Any] | None = None,
        key: str | None = None,
    ) -> Iterator[StageRecord]:
        """Record a stage: 'running' on entry, then 'completed', 'interrupted' (Ctrl-C) or 'failed'.

        The manifest stays valid at every point; on SIGKILL the record stays 'running' and readers
        report it as interrupted once the lock is free. A refusal (a QerlError while ``rec.refusable``) leaves
        the manifest as it was before the stage: its earlier bytes are written back (or it is removed again). A
        failure or interruption while ``rec.keeps_earlier`` leaves the key's earlier completed record in place.
        On entry, under the lock, what killed writers left staged in the run directory is removed, and disk space
        for the last manifest write is set aside, so a disk that fills up meanwhile still gets the outcome recorded.
        """
        from qerl_cli.env_info import environment

        with self.lock():
            data = self.read()  # refuses corrupted/newer manifests before anything is written
            before = self.manifest_path.read_bytes() if self.manifest_path.exists() else None
            remove_stale_staging(self.path)
            earlier = data["stages"].get(key or stage)
            rec = StageRecord(
                stage=stage,
                key=key or stage,
                config=config or {},
                inputs=inputs or {},
                seeds=seeds or {},
                env=environment(),
            )
            reserve = self._reserve(2 * len(before or b"") + MANIFEST_RESERVE_BYTES)
            try:
                self._commit(data, rec)
            except BaseException:
                _release(reserve)
                raise
            t0 = time.perf_counter()
            refused = False
            try:
                yield rec
            except KeyboardInterrupt:
                rec.status = "interrupted"
                raise
            except BaseException as exc:
                refused = rec.refusable and isinstance(exc, QerlError)
                rec.status = "failed"
                rec.error = str(exc).splitlines()[0][:500] if str(exc) else exc.__class__.__name__
                raise
            else:
                rec.status = "completed"
            finally:
                rec.finished = now_iso()
                rec.duration_s = round(time.perf_counter() - t0, 3)
                keep = earlier if rec.status != "completed" and rec.keeps_earlier and isinstance(earlier, dict) \
                    and earlier.get("status") == "completed" else None
                try:
                    self._last_write(reserve, lambda: self._restore(before) if refused
                                     else self._commit(self.read(), rec, keep=keep))
                finally:
                    _release(reserve)

    def _reserve(self, size: int) -> Path | None:
        """A file of ``size`` allocated bytes (None where even that does not fit): freed to write the stage's last
        record when the disk is full by then."""
        path = self.path / f".{MANIFEST_NAME}.reserve-{os.getpid()}"
        try:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            try:
                os.posix_fallocate(fd, 0, size)
            finally:
                os.close(fd)
        except OSError:
            _release(path)
            return None
        return path

    def _last_write(self, reserve: Path | None, write: Callable[[], None]) -> None:
        """``write`` the stage's last manifest update; where the disk is full (a QerlError from the write), again
        once the reserve is freed."""
        try:
            write()
        except QerlError:
            if reserve is None or not reserve.exists():
                raise
            _release(reserve)
            write()

    def _restore(self, before: bytes | None) -> None:
        """The manifest as a refused stage found it (nothing else writes it while the stage holds the lock)."""
        if before is not None:
            atomic_write_bytes(self.manifest_path, before)
        else:
            with contextlib.suppress(FileNotFoundError):
                self.manifest_path.unlink()

    def _commit(self, data: dict[str, Any], rec: StageRecord, keep: dict[str, Any] | None = None) -> None:
        """Write ``rec`` into the manifest (``keep``: the record to leave under its key instead; ``rec`` goes into the
        history only)."""
        entry = rec.to_dict()
        data["stages"][rec.key] = keep if keep is not None else entry
        history = data["history"]
        summary = {k: entry[k] for k in ("stage", "key", "attempt", "status", "started", "finished")}
        if history and history[-1].get("attempt") == rec.attempt:
            history[-1] = summary
        else:
            history.append(summary)
        data["updated"] = now_iso()
        self._write(data)

    def save(self, rec: StageRecord) -> None:
        """Persist a running stage's record now (long stages call this as they make progress)."""
        self._commit(self.read(), rec)

    def update_record(self, key: str, **fields: Any) -> None:
        """Merge fields into the record under `key` (used by long stages to checkpoint progress)."""
        with self.lock():
            data = self.read()
            if key not in data["stages"]:
                raise StageMissingError(f"no {key} stage recorded in {self.path}")
            data["stages"][key].update(fields)
            data["updated"] = now_iso()
            self._write(data)
