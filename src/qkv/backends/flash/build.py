"""Building a compiled extension once, even when a build is stopped part-way or runs beside another.

torch's extension builder (``torch.utils.cpp_extension.load``) guards each build folder with a
file named ``lock``: created when a build starts, removed when it ends, and waited on, silently
and without end, by every other process that finds it. A build killed part-way (SIGKILL, the OOM
killer, a restarted notebook, a CI timeout) never removes it, and every later process then waits
for ever.

So qkv holds a lock of its own around each build: an operating-system lock (``flock``;
``msvcrt.locking`` on Windows) on a file next to the build folder (``<folder>.lock``). The
operating system releases it when its holder dies, so it is never left behind. Every qkv builder
holds it for its whole build, so a torch ``lock`` that the holder finds was left by a builder that
died: that folder, with whatever it half-built, is set aside and the build starts over. A process
that finds another live builder waits for it, saying so on stderr, for at most
``QKV_BUILD_TIMEOUT`` seconds (``BUILD_TIMEOUT_S``), then gives up with a ``BuildError`` that
names the folder.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType

# How long a process waits for another one's build before it gives up (QKV_BUILD_TIMEOUT
# overrides it): ten times a build's usual minute, for a loaded machine.
BUILD_TIMEOUT_S = 600.0
POLL_S = 0.2  # how often a waiting process tries the lock again
NOTE_EVERY_S = 60.0  # how often it says it is still waiting
TORCH_LOCK = "lock"  # the file torch's builder holds in the build folder while it builds


class BuildError(RuntimeError):
    """An extension that could not be built: the message names its build folder."""


def build_timeout() -> float:
    """How many seconds to wait for another process's build: ``QKV_BUILD_TIMEOUT`` or
    ``BUILD_TIMEOUT_S``."""
    text = os.environ.get("QKV_BUILD_TIMEOUT")
    if text is None:
        return BUILD_TIMEOUT_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:  # NaN too
        raise ValueError(f"QKV_BUILD_TIMEOUT: expected a number of seconds ≥ 0, got {text!r}")
    return seconds


def extension_folder(name: str) -> Path:
    """The folder torch builds extension ``name`` in (created if missing): ``name`` under
    ``TORCH_EXTENSIONS_DIR``, or under torch's default root in the user's cache."""
    from torch.utils import cpp_extension

    # torch's own function, so that the lock guards the folder torch really builds in.
    return Path(cpp_extension._get_build_directory(name, verbose=False))


def compile_extension(
    name: str, source: Path, cflags: Sequence[str], ldflags: Sequence[str], what: str
) -> ModuleType:
    """Extension ``name`` built from ``source`` with these compiler and linker flags, or its
    cached build loaded, while holding the build lock. ``what`` names it in the one line a
    build prints to stderr (a cached load prints nothing). Raises ``BuildError`` where it
    cannot be built, or where another live build holds the lock past ``build_timeout()``."""
    import ninja  # the build tool torch's extension builder runs
    from torch.utils import cpp_extension

    if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])
    timeout = build_timeout()
    folder = extension_folder(name)
    with exclusive(folder, timeout):
        # The library is a build's last output: without it torch compiles, which is worth a line.
        if not (folder / f"{name}{cpp_extension.LIB_EXT}").exists():
            _note(f"building {what} in {folder}, once: this takes about a minute")
        try:
            module: ModuleType = cpp_extension.load(
                name=name,
                sources=[str(source)],
                extra_cflags=list(cflags),
                extra_ldflags=list(ldflags),
                build_directory=str(folder),
            )
        except Exception as error:
            raise BuildError(f"building {what} in {folder} failed: {error}") from error
    return module


@contextlib.contextmanager
def exclusive(folder: Path, timeout: float) -> Iterator[None]:
    """Hold the build lock of ``folder`` (the file ``<folder>.lock``) for the ``with`` block,
    after setting aside what a builder that died there left. Waits at most ``timeout`` seconds
    for another live holder, then raises ``BuildError``."""
    descriptor = os.open(_lock_path(folder), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _acquire(descriptor, folder, timeout)
        os.ftruncate(descriptor, 0)
        os.write(descriptor, str(os.getpid()).encode())  # who builds, for waiters to name
        _restart_stopped_build(folder)
        try:
            yield
        finally:
            _unlock(descriptor)
    finally:
        os.close(descriptor)


def _lock_path(folder: Path) -> Path:
    """qkv's lock file of a build folder: beside it, so that setting the folder aside keeps it."""
    return folder.with_name(folder.name + ".lock")


def _note(message: str) -> None:
    """One line for the person waiting, on stderr (stdout may be a program's output)."""
    print(f"qkv: {message}", file=sys.stderr, flush=True)


def _acquire(descriptor: int, folder: Path, timeout: float) -> None:
    """Take the lock, waiting while another process holds it: a note on stderr when the wait
    begins and every ``NOTE_EVERY_S``, a ``BuildError`` after ``timeout`` seconds."""
    started = time.monotonic()
    next_note = 0.0  # seconds into the wait
    while not _try_lock(descriptor):
        waited = time.monotonic() - started
        holder = _holder(folder)
        if waited >= timeout:
            raise BuildError(
                f"gave up after {waited:.0f} s waiting for {holder}, which is building in "
                f"{folder}. If it is stuck, stop it; else let it finish, then run `qkv build` "
                "or this call again. QKV_BUILD_TIMEOUT=SECONDS waits longer."
            )
        if waited >= next_note:
            still = "still " if next_note else ""
            _note(
                f"{still}waiting for {holder} to finish building in {folder} "
                f"({waited:.0f} s so far; gives up after {timeout:.0f} s, QKV_BUILD_TIMEOUT)"
            )
            next_note += NOTE_EVERY_S
        time.sleep(POLL_S)


def _holder(folder: Path) -> str:
    """The process that holds the lock of ``folder``, as its lock file names it."""
    try:
        pid = _lock_path(folder).read_text().strip()
    except OSError:  # on Windows the locked file cannot be read
        pid = ""
    return f"process {pid}" if pid.isdigit() else "another process"


def _restart_stopped_build(folder: Path) -> None:
    """Where torch's ``lock`` is left in ``folder`` (only a dead builder leaves it while this
    process holds qkv's lock), set the folder aside and start from an empty one: its files may be
    half-written, and a compiler the dead builder started may still be writing into it (ninja runs
    each in its own process group, so killing the builder's group can miss it). A renamed folder
    keeps such a compiler's relative writes away from the new build."""
    if not (folder / TORCH_LOCK).exists():
        return
    _note(f"{folder / TORCH_LOCK} was left by a build that stopped part-way; building again")
    set_aside = Path(tempfile.mkdtemp(prefix=f"{folder.name}.stopped-", dir=folder.parent))
    folder.rename(set_aside / folder.name)
    shutil.rmtree(set_aside, ignore_errors=True)
    folder.mkdir()


def _try_lock(descriptor: int) -> bool:
    """Take the operating-system lock on this open file if no other process holds it."""
    try:
        if sys.platform == "win32":
            import msvcrt

            os.lseek(descriptor, 0, os.SEEK_SET)
            msvcrt.locking(descriptor, msvcrt.LK_NBLCK, 1)
        else:
            import fcntl

            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except (BlockingIOError, PermissionError):  # held by another process
        return False
    return True


def _unlock(descriptor: int) -> None:
    if sys.platform == "win32":
        import msvcrt

        os.lseek(descriptor, 0, os.SEEK_SET)
        msvcrt.locking(descriptor, msvcrt.LK_UNLCK, 1)
    else:
        import fcntl

        fcntl.flock(descriptor, fcntl.LOCK_UN)
