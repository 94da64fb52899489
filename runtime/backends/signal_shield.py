"""SIGINT and SIGTERM kept out of native calls that cannot take them, and heard at once by a thread.

llama.cpp's RPC client aborts the whole process where a receive fails, and a signal that lands on
a thread blocked in ``recv()`` makes it fail (EINTR): a Ctrl-C while llama.cpp waited for a
server's reply was SIGABRT at once. So around such a call (``shielded()``) the calling thread
blocks both signals, and the threads llama.cpp starts meanwhile inherit that mask: a signal then
lands on a thread that takes it (the watcher's, or any other of ours), where Python's C-level
handler records it as usual; Python's own handler runs once the main thread is back in Python.

The call itself may wait for a long time (a stalled server), so the ``Watcher`` hears a signal at
once, whichever thread took it: it reads Python's wakeup fd (the byte the C-level handler writes
for every signal Python handles) in a thread of its own, passes the byte on to the wakeup fd that
was set before (asyncio's, where there was one) and tells its listeners (an RPC guard then answers
llama.cpp's waiting call itself, so the call returns and the signal is handled).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import weakref
from collections.abc import Iterator
from typing import Protocol

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Listener(Protocol):
    def interrupted(self, signum: int) -> None: ...


@contextlib.contextmanager
def shielded() -> Iterator[None]:
    """Block SIGINT and SIGTERM in this thread (and the threads native code starts) for the block."""
    if not hasattr(signal, "pthread_sigmask"):  # Windows: no masks
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)  # a signal kept pending for this thread comes now


class Watcher:
    """A thread that hears SIGINT and SIGTERM as they arrive and tells its listeners (from that
    thread: a listener only sets flags and starts timers)."""

    def __init__(self) -> None:
        self._listeners: weakref.WeakSet[Listener] = weakref.WeakSet()
        self._started = False
        self._lock = threading.Lock()

    def listen(self, listener: Listener) -> None:
        """Tell ``listener`` of every signal from now on (kept while it lives); starts the thread
        the first time, where it can (Python sets its wakeup fd from the main thread only)."""
        self._listeners.add(listener)
        with self._lock:
            if not self._started:
                self._started = self._start()

    def tell(self, signum: int) -> None:
        for listener in list(self._listeners):
            listener.interrupted(signum)

    def _start(self) -> bool:
        if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
            return False
        read, write = socket.socketpair()
        write.setblocking(False)
        try:
            before = signal.set_wakeup_fd(write.fileno(), warn_on_full_buffer=False)
        except (ValueError, OSError):
            read.close()
            write.close()
            return False
        threading.Thread(target=self._run, args=(read, write, before), name="signal watcher", daemon=True).start()
        return True

    def _run(self, read: socket.socket, write: socket.socket, before: int) -> None:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)  # started from a shielded thread: takes them again
        while True:
            try:
                data = read.recv(64)
            except OSError:
                return
            if not data:
                return
            if before >= 0:  # asyncio's loop reads the signals it handles from there
                with contextlib.suppress(OSError):
                    os.write(before, data)
            for signum in data:
                if signum in SIGNALS:
                    self.tell(signum)


watcher = Watcher()
