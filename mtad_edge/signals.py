"""SIGINT and SIGTERM for the console script: both stop work the same way, never mid-cleanup.

Python's own handling is unsafe for a process that owns native llama.cpp objects and promises its
output: SIGINT becomes a KeyboardInterrupt wherever the main thread happens to be (between a
native free and the line that forgets the freed handle, inside llama.cpp's log callback where
ctypes swallows it, or while the JSON answer is printed), a second Ctrl-C lands inside the
cleanup of the first, SIGTERM kills the process without a word, and during interpreter
finalization SIGINT's default action comes back (exit -2, or a traceback).

``interrupts`` (installed by the console script, mtad_edge/console.py) gives both signals one
meaning:

- by default the first signal raises KeyboardInterrupt, as Ctrl-C does in any Python program,
  and then stops raising (until ``handled``), so the code that handles it is never cut by a
  second one;
- after ``hold()`` a signal is only recorded (``code`` reports it): the commands that own models
  hold before loading them, so a signal never lands in native code's callbacks or cleanup;
- inside ``stopping(cancel)`` a signal calls ``cancel`` (a Response's ``cancel``: the run ends at
  its next step, and what was generated is kept);
- ``finish`` ends the process with 128 + the first signal received (130 for SIGINT, 143 for
  SIGTERM), blocking both signals before it decides, so one that arrives at the very end still
  counts and can no longer kill the process half-way through its exit.

Without ``install`` (the Python API, click's CliRunner in tests) nothing changes: these calls only
set attributes that no handler reads.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import NoReturn, Optional

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupts:
    def __init__(self) -> None:
        self.received: list[int] = []  # signal numbers, in order, not yet handled
        self._raising = True
        self._on_signal: Optional[Callable[[], None]] = None
        self.installed = False
        self.hard_exit = False  # finish with os._exit (see finish)

    def install(self) -> None:
        """Handle SIGINT and SIGTERM from now on (main thread only). A signal the process was
        started with ignored (``nohup``, a background job) stays ignored."""
        if threading.current_thread() is not threading.main_thread():
            return
        self.received.clear()
        self._raising = True
        for sig in SIGNALS:
            if signal.getsignal(sig) is not signal.SIG_IGN:
                signal.signal(sig, self._handle)
        self.installed = True

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        self.received.append(signum)
        if self._on_signal is not None:
            self._on_signal()  # sets an Event the main thread never waits on: safe here
        elif self._raising:
            self._raising = False  # the handler of this one must not be cut by the next
            raise KeyboardInterrupt

    def hold(self) -> None:
        """From now on signals are only recorded (``code`` reports them), or stop a run inside
        ``stopping``."""
        self._raising = False

    @contextlib.contextmanager
    def stopping(self, cancel: Callable[[], None]) -> Iterator[None]:
        """Within the block a signal calls ``cancel`` (at once for one that arrived before)."""
        if self.installed and self.received:
            cancel()
        self._on_signal = cancel
        try:
            yield
        finally:
            self._on_signal = None

    def handled(self) -> None:
        """The last interrupt has been dealt with (the chat stopped an answer and goes on): forget
        it and raise at the next one."""
        self.received.clear()
        self._raising = True

    @property
    def code(self) -> Optional[int]:
        """The exit status the signals received ask for: 128 + the first one's number."""
        return 128 + self.received[0] if self.received else None

    def finish(self, code: int) -> NoReturn:
        """End the process: ``code``, or 128 + the first signal received (even one that arrives
        now: both are blocked first and pending ones counted). With ``hard_exit`` (set by the
        commands that own native models, once they have freed them and flushed their output),
        or wherever llama.cpp was loaded, the process runs Python's atexit work and ends with
        os._exit, without an interpreter finalization in which a late signal or a native
        destructor could still misbehave."""
        if self.installed and hasattr(signal, "pthread_sigmask"):
            signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
            self.received += sorted(signal.sigpending() & set(SIGNALS))
        final = self.code if self.installed and self.code is not None else code
        _flush()
        if self.hard_exit or "llama_cpp" in sys.modules:
            # a process that loaded llama.cpp skips native finalization: on CUDA its exit segfaulted
            # (exit 139 after a bench's report, models closed); Python's own exit work still runs
            atexit._run_exitfuncs()
            _flush()
            os._exit(final)
        sys.exit(final)


def _flush() -> None:
    """Flush stdout and stderr; one that cannot be flushed is pointed at /dev/null."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed pipe or a full disk cannot change the exit status, nor print
            with contextlib.suppress(Exception):  # a traceback as the interpreter flushes it again
                os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())


interrupts = Interrupts()
