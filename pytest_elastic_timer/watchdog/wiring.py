"""The watchdog process's wiring, run by ``python -m pytest_elastic_timer.watchdog``.

:func:`build` makes the :class:`~.server.Watchdog` and plugs its intakes in (the torch
file-timer FIFO, the synchronization primitives, the JUnit file written if pytest dies
first); :func:`main` parses the launcher's arguments, sets up the process's signals,
says ``ready <pid> <address>`` on stdout and serves until the session ends. The plugin
hands it the session's socket already listening (``--listen-fd``), so that nobody waits
for this process to start; without one, it binds the socket itself. This is the only
module that knows both the watchdog and its intakes.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pytest_elastic_timer.sync import protocol
from pytest_elastic_timer.watchdog import control, proctree
from pytest_elastic_timer.watchdog.control import StdinRelay
from pytest_elastic_timer.watchdog.file_timer import FileTimerIntake
from pytest_elastic_timer.watchdog.forwarded import ForwardedRecords
from pytest_elastic_timer.watchdog.loop import Clock
from pytest_elastic_timer.watchdog.server import Terminated, Watchdog

if TYPE_CHECKING:
    from pytest_elastic_timer.sync.server import Handler, SyncServer
    from pytest_elastic_timer.watchdog.remote_host import HostRole


class SyncIntake:
    """The server of barriers, events and locks, made at the session's first call of
    one: most sessions make none, and its modules would cost every watchdog's start-up
    some 5 ms of a core, while pytest, beside it, runs its session."""

    def __init__(self, dog: Watchdog) -> None:
        self.dog = dog
        self.server: SyncServer | None = None
        self._handlers: dict[str, Handler] = {}
        for op in protocol.OPS:
            dog.handle(op, functools.partial(self._first_call, op))
        dog.on_disconnect(self.disconnected)

    def _first_call(
        self, op: str, conn: socket.socket, peer_pid: int, fields: dict[str, Any]
    ) -> None:
        if self.server is None:
            try:
                from pytest_elastic_timer.sync.server import SyncServer

                server = SyncServer(self.dog)
            except Exception as exc:
                # The caller gets an answer and the session keeps its watchdog; the
                # next call tries again.
                sys.stderr.write(f"pytest-elastic-timer: sync primitives: {exc!r}\n")
                self.dog.drop()
                self.dog.send(conn, protocol.ERROR, error=f"sync primitives unavailable: {exc}")
                return
            self.server = server
            self._handlers = server.handlers()
            for name, handler in self._handlers.items():
                self.dog.handle(name, handler)  # the calls after this one go straight to it
        self._handlers[op](conn, peer_pid, fields)

    @property
    def calls(self) -> dict[socket.socket, tuple[str, str, Any]]:
        """The open calls: connection -> (kind, name, waiter)."""
        return self.server.calls if self.server is not None else {}

    def disconnected(self, conn: socket.socket) -> None:
        if self.server is not None:
            self.server.disconnected(conn)


@dataclass
class Assembly:
    """A watchdog and the intakes plugged into it."""

    dog: Watchdog
    file_timers: FileTimerIntake
    sync: SyncIntake
    # The watchdog of a host other than the controller's has its role there; the
    # controller's takes in the records of the others.
    remote: HostRole | None = None

    def close(self) -> None:
        """Let go of everything without ending the session (for a watchdog a test
        drove; :meth:`Watchdog.finish` ends a session and closes it all too)."""
        if self.remote is not None:
            self.remote.close()
        self.file_timers.close()
        self.dog.close()


def build(
    directory: str,
    *,
    root: proctree.ProcessId,
    junit_xml: str | None = None,
    clock: Clock = time.monotonic,
    host_name: str | None = None,
    linger: float | None = None,
    fifo_fd: int = -1,
    **settings: Any,
) -> Assembly:
    """A watchdog serving ``directory`` for the session below ``root``, with every
    intake plugged in; ``settings`` are :class:`Watchdog`'s keyword arguments. With
    ``host_name``, the watchdog of that host, which is not the controller's: the
    workers there join it (``root`` is the one that started it), and it ends ``linger``
    seconds after their gateways (None: :data:`.remote_host.DEFAULT_LINGER`).
    ``fifo_fd``: the read end of the torch file-timer FIFO that the plugin made (-1:
    make one)."""
    dog = Watchdog(directory, root=root, clock=clock, root_is_pytest=host_name is None, **settings)
    file_timers = FileTimerIntake(dog, directory, fifo_fd)
    dog.add_reader(file_timers.read_fd, file_timers.readable)
    for op, handler in file_timers.handlers().items():
        dog.handle(op, handler)
    dog.on_finish(file_timers.close)
    sync = SyncIntake(dog)
    if junit_xml:
        dog.on_finish(lambda: _junit_if_pytest_died(dog, junit_xml))
    remote = None
    if host_name is not None:
        # Only here: a host's role loads what identifies hosts (hashlib, tempfile), which
        # the controller's watchdog, started with every session, does not need.
        from pytest_elastic_timer.watchdog import remote_host

        remote = remote_host.install(
            dog, host_name, remote_host.DEFAULT_LINGER if linger is None else linger
        )
    else:
        forwarded = ForwardedRecords(dog, root.pid, dog.workers.add)
        for op, handler in forwarded.handlers().items():
            dog.handle(op, handler)
    return Assembly(dog, file_timers, sync, remote)


def _junit_if_pytest_died(dog: Watchdog, path: str) -> None:
    if not dog.root_died:
        return  # pytest writes its own file
    from pytest_elastic_timer.ci import junit_fallback  # only then: xml is slow to import

    try:
        junit_fallback.write(path, dog.records, dog.session)
    except OSError as exc:
        sys.stderr.write(f"pytest-elastic-timer: cannot write {path}: {exc}\n")


def _on_terminate(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    raise Terminated(signum)


def main(argv: list[str] | None = None, relay: StdinRelay | None = None) -> int:
    """Run a session's watchdog with the launcher's arguments; ``relay``, where
    ``__main__`` started one, is how it reads pytest's control pipe (else stdin)."""
    parser = argparse.ArgumentParser(prog="python -m pytest_elastic_timer.watchdog")
    parser.add_argument("--dir", required=True)
    parser.add_argument("--root-pid", type=int, required=True)
    parser.add_argument("--grace", type=float, default=2.0)
    parser.add_argument("--kill-after", type=float, default=1.0)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--report", default=None)
    parser.add_argument("--session", default="{}", help="JSON facts for the report")
    parser.add_argument("--dump-signal", type=int, default=0)
    parser.add_argument("--junit-xml", default=None, help="fallback JUnit XML if pytest dies")
    parser.add_argument("--trace", action="store_true", help="clients record every scope")
    parser.add_argument(
        "--host-name",
        default=None,
        help="the watchdog of this host, not the controller's: workers join it, and it "
        "ends with their gateways (watchdog/remote_host.py); records name this host",
    )
    parser.add_argument("--linger", type=float, default=None)
    parser.add_argument(
        "--listen-fd",
        type=int,
        default=-1,
        help="the session's socket, bound and listening already (inherited)",
    )
    parser.add_argument(
        "--fifo-fd",
        type=int,
        default=-1,
        help="the read end of the session's torch file-timer FIFO, made already (inherited)",
    )
    parser.add_argument(
        "--defer",
        type=float,
        default=0.0,
        help="seconds to wait for the session's end before loading the watchdog's modules "
        "(read by __main__; pytest does not wait for this session's end)",
    )
    args = parser.parse_args(argv)
    # Ctrl-C reaches the whole process group; pytest decides how the session ends.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for signum in control.TERMINATING:
        signal.signal(signum, _on_terminate)
    listener = None
    if args.listen_fd >= 0:
        listener = socket.socket(fileno=args.listen_fd)
    root = proctree.ProcessId.of(args.root_pid)
    if root is None and args.host_name is not None:
        return 1  # the worker that starts a host's watchdog waits for it
    if root is None:
        # pytest ended before this process got here (it does not wait for the watchdog
        # to start). Its session still gets the report and loses its directory: the
        # control pipe is at end-of-file, so the watchdog finishes at once. An identity
        # no process has: nothing is vouched for as a descendant of it.
        root = proctree.ProcessId(args.root_pid, -1.0)
    dog = build(
        args.dir,
        root=root,
        junit_xml=args.junit_xml,
        grace=args.grace,
        kill_after=args.kill_after,
        scale=args.scale,
        report_path=args.report,
        session=json.loads(args.session),
        # The controller's watchdog learns of pytest's death from its stdin; a host's
        # from the gateways of its workers.
        control=None if args.host_name is not None else relay or sys.stdin.buffer,
        host_name=args.host_name,
        linger=args.linger,
        dump_signal=args.dump_signal,
        trace=args.trace,
        listener=listener,
        fifo_fd=args.fifo_fd,
    ).dog
    sys.stdout.write(f"ready {os.getpid()} {dog.address}\n")
    sys.stdout.flush()
    # Held since the process started (__main__): one that came while the watchdog
    # loaded ends the session as a later one does.
    dog.serve(held=control.TERMINATING)
    return 0
