"""This process's link to the session: its scope table and its watchdog connection.

A process finds the watchdog through the ``PYTEST_ELASTIC_TIMER`` environment variable
(the path of the watchdog's socket), which the plugin sets for the whole session so
that every child process inherits it. The client has no thread and never polls: it
writes scopes into its shared table and sends a message only when the watchdog has to
wake earlier than it already promised to. Without a watchdog (plain ``python``, or the
watchdog went away) an in-process sentinel thread enforces the same table, with the
weaker guarantees documented in ``docs/design.md``. A process that has no interrupt
signal (its first scope was entered outside its main thread, where no signal handler
can be installed) hands the watchdog an interrupt channel instead, on which a thread
of its own waits.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import itertools
import math
import os
import signal
import socket
import sys
import threading
from collections import deque
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any

from pytest_elastic_timer.core import startup, unpatched, wire
from pytest_elastic_timer.core import table as tbl
from pytest_elastic_timer.scope import ranklabel

ENV_ADDRESS = "PYTEST_ELASTIC_TIMER"
ENV_SCALE = "PYTEST_ELASTIC_TIMER_SCALE"  # the session's scale factor
ENV_TRACE = "PYTEST_ELASTIC_TIMER_TRACE"  # "1": the session writes a trace timeline

# The package's own threads (the standby and the sentinel) are named with this prefix:
# they start no processes, so a look for a test's child processes may pass them over.
THREAD_PREFIX = "elastic-timer-"

# How long a process waits for the watchdog's answer to its hello where it needs it: as
# long as a loaded machine may take to start the watchdog's interpreter.
WELCOME_TIMEOUT = 30.0
# Messages kept in the process while the watchdog has not answered yet and its
# connection is full; beyond this many, the oldest are dropped (and the watchdog still
# finds what their scopes' slots say).
UNSENT_LIMIT = 10_000

SignalHandler = Callable[[int, FrameType | None], Any]
# Where a scope is entered, as ProcessState.lookup_entry finds it: (code or explicit
# place, parent path, name, site sid, scope path, path sid, whether the code is a
# coroutine's, by its flags CO_ASYNC: asyncio tasks are cancelled rather than
# interrupted).
SiteEntry = tuple[Any, str, str | None, int, str, int, bool]
# Frames that only pass a scope's entry on: contextlib's (ExitStack, contextmanager) and
# this package's. The site of a scope entered through them is the first frame beyond.
_CONTEXTLIB_FILE = contextlib.__file__
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _user_frame(frame: FrameType) -> FrameType:
    """The first frame from ``frame`` outwards that is neither contextlib's nor this
    package's (``frame`` itself if there is none)."""
    found: FrameType | None = frame
    while found is not None:
        filename = found.f_code.co_filename
        if filename != _CONTEXTLIB_FILE and not filename.startswith(_PACKAGE_DIR):
            return found
        found = found.f_back
    return frame


CO_ASYNC = inspect.CO_COROUTINE | inspect.CO_ITERABLE_COROUTINE | inspect.CO_ASYNC_GENERATOR

# A test may replace these with mocks, and what this package does in that test's
# process must not call them.
_monotonic = unpatched.monotonic
_connect = unpatched.connect
_select = unpatched.select


def label_from_env() -> str:
    """The label this process has by default: ``rank N`` of its global rank once it
    called ``init_process_group``, before that from ``RANK`` or ``LOCAL_RANK``; ""
    without one."""
    if ranklabel.label:  # init_process_group said which global rank this is
        return ranklabel.label
    for name in ("RANK", "LOCAL_RANK"):
        value = os.environ.get(name)
        if value is not None and value.strip().lstrip("-").isdigit():
            return f"rank {int(value)}"
    return ""


def _free_signals(count: int, ours: SignalHandler) -> list[int]:
    """``count`` real-time signals that nobody in this process handles yet.

    A handler the code under test installed is never replaced: a signal is taken only
    when its handler is the default one, or ours (after a fork).
    """
    if hasattr(signal, "SIGRTMIN"):
        reserved = startup.session_dump_signal()
        candidates = [s for s in range(signal.SIGRTMIN + 2, signal.SIGRTMAX - 1) if s != reserved]
    else:  # macOS and friends have no real-time signals
        candidates = [signal.SIGUSR1, signal.SIGUSR2]
    chosen = []
    for signum in candidates:
        current = signal.getsignal(signum)
        if current in (signal.SIG_DFL, None) or current is ours:
            chosen.append(signum)
            if len(chosen) == count:
                break
    return chosen


# Signals a thread raises by its own faults: the kernel sends them to that thread, and
# a crash there must still reach faulthandler.
_FAULTS = frozenset(
    getattr(signal, name)
    for name in ("SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGTRAP", "SIGSYS", "SIGABRT")
    if hasattr(signal, name)
)


def start_helper(thread: threading.Thread) -> None:
    """Start one of the package's helper threads with the process's signals blocked in it.

    A signal sent to the process (Ctrl-C, the watchdog's interrupt, pytest-timeout's
    alarm) is then taken by a thread that can act on it. Its Python handler runs in the
    main thread whichever thread took it, but only a signal the main thread took breaks
    it out of a blocking call: ``time.sleep(120)`` would sleep on. A thread starts with
    the mask of the thread that starts it, so the mask is set around the start.
    """
    if not hasattr(signal, "pthread_sigmask"):
        thread.start()
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals() - _FAULTS)
    try:
        thread.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


# Runs of this process's interrupt handler so far (the handler counts them): a thread of
# the package that sent the main thread its interrupt sees by it whether it was heard.
handler_runs = 0
# How long such a thread waits for the handler to run before it sends the signal again
# (each wait twice the last, up to RESEND_MAX), and for how long it goes on.
RESEND_AFTER = 0.005
RESEND_MAX = 0.1
RESEND_FOR = 5.0


def interrupt_main_thread(signum: int) -> None:
    """Send ``signum`` to this process's main thread, where its Python handler runs, and
    send it again until the handler has run.

    Not to the process: a thread of the test (not blocking signals, unlike the package's
    own) could take it while the main thread sleeps in a blocking call, and the handler
    would wait until that call returned.

    Again, because a signal that comes while the main thread is on its way into a
    blocking call, after the interpreter last looked for signals, only marks the handler
    as due: ``time.sleep(5)`` sleeps on, and the handler runs when it returns. That is
    where the calling thread, waiting for the GIL, gets it: the main thread lets go of
    it just before it blocks. A signal sent while it blocks breaks it out.
    """
    main = threading.main_thread().ident or 0
    if main == unpatched.get_ident():  # the handler runs before pthread_kill returns
        with contextlib.suppress(ProcessLookupError):
            signal.pthread_kill(main, signum)
        return
    wait = RESEND_AFTER
    give_up = _monotonic() + RESEND_FOR
    while True:
        with contextlib.suppress(ProcessLookupError):  # the interpreter is ending
            signal.pthread_kill(main, signum)
        # Counted after the signal went out: a run that began before it did not hear
        # it (at worst the signal goes once more than it had to).
        runs = handler_runs
        unpatched.sleep(wait)
        if handler_runs != runs or _monotonic() >= give_up:
            return
        wait = min(2 * wait, RESEND_MAX)


class ProcessState:
    """Everything a scope needs from its process, set up at the first scope entered."""

    def __init__(self, on_interrupt: SignalHandler) -> None:
        self.pid = unpatched.getpid()
        # Whether scopes entered with this state write its table: not once it is
        # closed, nor in a child forked from this process (the table is the parent's).
        self.usable = True
        self.address = os.environ.get(ENV_ADDRESS) or None
        self.sock: socket.socket | None = None
        self.sentinel: Sentinel | None = None
        self.scale = scale_from_env()
        self.grace = 2.0
        self._watchdog_pid = 0
        # The watchdog's answer to our hello is read only where something needs it
        # (a request, its pid, a look whether it is still there): connecting never
        # waits for the watchdog, which may still be starting.
        self.welcomed = False
        self.refused = ""  # why the watchdog refused this process, if it did
        # The process that started the watchdog does not wait for its answer: until it
        # comes, a thread stands by to enforce scopes in-process should it never come.
        self.welcome_in_background = False
        # Told of each deadline this process enters before the watchdog's answer (the
        # plugin: a watchdog that loads late is hurried for one it would be late for).
        self.before_welcome: Callable[[float], None] | None = None
        self.standby: threading.Thread | None = None
        self.standby_socket: socket.socket | None = None  # what the thread waits on
        # Wakes the standby thread: a deadline earlier than it knew, or the answer read.
        self.standby_waker: socket.socket | None = None
        self.standby_woken: socket.socket | None = None  # the thread's end
        # The earliest "wake" sent before the watchdog answered: it has yet to read
        # them, and the first it reads makes it look at the whole table.
        self.wake_queued = float("inf")
        # Messages for a watchdog that has not answered yet, which found its connection
        # full (a process that sends on a full connection blocks until the watchdog
        # reads: in its signal handler, and maybe before the code that lets the watchdog
        # come up runs). Sent in order once it answers.
        self.unsent: deque[bytes] = deque(maxlen=UNSENT_LIMIT)
        self.sending = threading.Lock()  # one sender of the unsent at a time
        self.standby_ended = False  # close() was called: a standby thread ends quietly
        self.table_closed = False  # close() unmapped the table (nothing reads it then)
        self.lose_lock = threading.Lock()
        # Free slots. A deque: a list that a loop's one scope empties and fills again
        # is shrunk and grown (a realloc each way) by every scope.
        self.free: deque[int] = deque()
        self.hwm = 0
        self.serials = itertools.count(1)  # next(serials): the serial of a slot opened
        self.sids: dict[str, int] = {}
        self.sites: dict[tuple[CodeType, int], tuple[int, str]] = {}
        # Call sites: id(code) + bytecode offset -> (code, parent, name, *entry()),
        # and every (code or place, offset, parent, name) in the slower dictionary.
        self.sites_fast: dict[int, SiteEntry] = {}
        self.entries: dict[tuple[object, ...], SiteEntry] = {}
        self.paths: dict[tuple[str, str], str] = {}
        self.nodeid = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
        self.nodeid_sid = 0
        # Code entered a scope at a call site of its own (not a test phase's scope,
        # which the plugin enters at the test's definition): the process uses scopes.
        self.entered_scopes_of_its_own = False
        self.warned = False
        # Trace events (path, start, end, thread, nodeid, expired) while the session
        # writes a trace timeline; None otherwise (the hot path checks only that).
        self.trace: list[tuple[str, float, float, int, str, bool]] | None = None
        self.trace_flushed = 0.0
        self.alive_checked = 0.0
        self.on_interrupt = on_interrupt
        # In a process without an interrupt signal, the thread that takes the
        # watchdog's interrupts instead (see Interrupter).
        self.interrupter: Interrupter | None = None
        self.previous_handler: signal.Handlers | SignalHandler | int | None = None
        self.dump: startup.DumpRegistration | None = None
        self.interrupt_sig, self.dump_sig = self._install_signals(on_interrupt)
        self.table = self._attach()
        self.armed = self.table.floats  # hot path: armed[tbl.H_ARMED]
        self.nodeid_sid = self.sid(self.nodeid)
        self.table.words[tbl.H_INTERRUPT_SIG] = self.interrupt_sig
        self.table.words[tbl.H_DUMP_SIG] = self.dump_sig
        self.table.words[tbl.H_MAIN_TID] = threading.main_thread().ident or 0
        self.label_given = False  # set_label() was called: a rank keeps that label
        self.set_label(label_from_env())
        self.table.words[tbl.H_WORKER_SID] = self.sid(os.environ.get("PYTEST_XDIST_WORKER", ""))

    # -- set-up ---------------------------------------------------------------------
    def _install_signals(self, on_interrupt: SignalHandler) -> tuple[int, int]:
        preset = startup.preset_dump()
        free = [s for s in _free_signals(3, on_interrupt) if not preset or s != preset[0]]
        # signal.signal() works only in the main thread: a process whose first scope is
        # entered in another one has no interrupt signal, and a thread of the package
        # delivers its interrupts (faulthandler, for the dumps, registers anywhere).
        in_main_thread = threading.current_thread() is threading.main_thread()
        interrupt_sig = free[0] if free and in_main_thread else 0
        if preset:
            dump_sig = preset[0]
        elif len(free) > 1:
            dump_sig = free[1]
        else:
            dump_sig = 0
        if interrupt_sig:
            # Python installs handlers without SA_RESTART: a blocking system call returns
            # EINTR, the handler runs (and raises), and other code retries (PEP 475).
            self.previous_handler = signal.signal(interrupt_sig, on_interrupt)
        return interrupt_sig, dump_sig

    def _attach(self) -> tbl.ScopeTable:
        if self.address:
            try:
                return self._connect(self.address)
            except (OSError, wire.BadMessage, ValueError) as exc:
                self._read_refusal()
                if self.refused:
                    why = f"the watchdog refused this process ({self.refused})"
                else:
                    why = f"cannot reach the watchdog at {self.address} ({exc})"
                self._warn(f"{why}; enforcing scopes in-process")
                self._close_socket()
        table = tbl.ScopeTable.create(None)
        self.sentinel = Sentinel(self, table)
        return table

    def _read_refusal(self) -> None:
        """A watchdog that refused this process before its hello went out (which then
        failed) said why: ``refused`` keeps it."""
        sock = self.sock
        if sock is None:
            return
        with contextlib.suppress(OSError, wire.BadMessage):
            op, fields = wire.decode(sock.recv(wire.MAX_MESSAGE, socket.MSG_DONTWAIT))
            if op == "refused":
                self.refused = str(fields.get("error", "")) or op

    def _connect(self, address: str) -> tbl.ScopeTable:
        directory = os.path.dirname(address)
        sock = unpatched.Socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.settimeout(10.0)
        try:
            _connect(sock, address)
        except BaseException:
            sock.close()  # not ours yet: _close_socket() would not see it
            raise
        self.sock = sock
        path = os.path.join(directory, tbl.file_name(self.pid))
        table = tbl.ScopeTable.create(path)
        dump_path = ""
        preset = startup.preset_dump()
        here = os.path.realpath(directory)
        if (
            preset
            and self.dump_sig == preset[0]
            and os.path.dirname(os.path.realpath(preset[1])) == here
        ):
            dump_path = preset[1]  # registered at start-up already
        elif self.dump_sig:
            # No handler yet, or one into another session's directory (a pytest run
            # inside a test of another): dump into this session's directory until
            # close() puts the earlier registration back.
            dump_path = os.path.join(directory, f"dump-{self.pid}-{unpatched.random_hex()}")
            self.dump = startup.register_dump(self.dump_sig, dump_path)
        hello = wire.encode("hello", pid=self.pid, table=path, dump=dump_path)
        if self.interrupt_sig:
            sock.sendall(hello)
        else:
            # No handler for a signal: the watchdog gets the end of a channel instead.
            mine, theirs = unpatched.socketpair()
            try:
                wire.send_with_fds(sock, hello, [theirs.fileno()])
            except BaseException:
                mine.close()
                raise
            finally:
                theirs.close()
            self.interrupter = Interrupter(self, mine)
        sock.settimeout(None)
        if os.environ.get(ENV_TRACE) == "1":
            self._start_trace(directory)
        # Closed at exit, so that a process that never calls close() (a child, an
        # xdist worker) is not warned about an unclosed socket.
        atexit.register(self._disconnect)
        return table

    def _start_trace(self, directory: str) -> None:
        self.trace = []
        self.trace_path = os.path.join(directory, f"trace-{self.pid}-{unpatched.random_hex()}")
        atexit.register(self.flush_trace)

    def welcome(self, wait: bool = True) -> None:
        """Read the watchdog's answer to this process's hello, once: ``welcome``, or
        ``refused`` or end-of-file (a watchdog that refused the process, died or never
        started), after which scopes are enforced in-process. Without ``wait``, only an
        answer that has arrived already is read."""
        sock = self.sock
        if self.welcomed or sock is None:
            return
        try:
            if wait:
                data = _receive_within(sock, WELCOME_TIMEOUT)
            else:
                data = sock.recv(wire.MAX_MESSAGE, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return  # not yet: the watchdog is still starting
        except (OSError, ValueError) as exc:  # (ValueError: closed meanwhile)
            self._lose(str(exc) or type(exc).__name__)
            return
        if not data:
            self._lose("the watchdog closed its connection")
            return
        try:
            op, fields = wire.decode(data)
        except wire.BadMessage as exc:
            self._lose(f"the watchdog said {exc}")
            return
        if op != "welcome":
            self.refused = str(fields.get("error", "")) or op
            self._lose(f"the watchdog answered {op!r}: {fields.get('error', '')}")
            return
        self.welcomed = True
        self._wake_standby()
        self._send_unsent()
        self.grace = float(fields.get("grace", self.grace))
        self._watchdog_pid = int(fields.get("pid", 0))
        if fields.get("trace") and self.trace is None and self.address:
            self._start_trace(os.path.dirname(self.address))

    def _stand_by(self) -> None:
        """Start the thread that waits for the watchdog's answer, unless it runs, or
        the answer (or the end of the connection) is here already."""
        sock = self.sock
        if self.welcomed or sock is None or self.standby is not None or self.standby_ended:
            return
        made: list[socket.socket] = []
        try:
            # A descriptor of its own: the thread never reads, or closes, the one this
            # process sends on.
            watched = unpatched.Socket(fileno=os.dup(sock.fileno()))
            made.append(watched)
            waker, woken = unpatched.socketpair()
            made += (waker, woken)
            standby = unpatched.Thread(
                target=self._await_welcome,
                args=(watched, woken),
                name=f"{THREAD_PREFIX}standby",
                daemon=True,
            )
            start_helper(standby)
        except (OSError, RuntimeError):
            # Out of descriptors or threads: wait for the answer here instead (the
            # deadline that asked for it must not go unheard).
            for made_socket in made:
                made_socket.close()
            self.welcome()
            return
        self.standby_socket, self.standby_waker, self.standby_woken = watched, waker, woken
        self.standby = standby

    def _wake_standby(self) -> None:
        waker = self.standby_waker
        if waker is not None:
            with contextlib.suppress(OSError):  # full, or the thread is gone
                waker.send(b"\0", socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)

    def _await_welcome(self, watched: socket.socket, woken: socket.socket) -> None:
        """The standby thread: wait for the watchdog's answer without reading it (the
        process reads it where it needs it); if the connection ends first, or nothing
        comes within ``WELCOME_TIMEOUT``, enforce scopes in-process from then on."""
        with watched, woken:
            why = self._stand_in(watched, woken)
        # The process may have read the answer, or lost the watchdog, meanwhile.
        if why and not self.standby_ended and not self.welcomed:
            self._lose(why)
        elif not why:
            self._send_unsent()  # the watchdog reads now: what waited for it goes

    def _stand_in(self, watched: socket.socket, woken: socket.socket) -> str:
        """Until the watchdog answers, interrupt this process at each deadline that
        passes, as the sentinel would: a short budget entered while the watchdog is
        still starting expires on time. Returns why the watchdog is lost, or "" once
        its answer is here (or this process read it, or closed)."""
        table = self.table
        give_up = _monotonic() + WELCOME_TIMEOUT
        fired: set[int] = set()
        while not self.welcomed and not self.standby_ended and self.sentinel is None:
            now = _monotonic()
            if now >= give_up:
                return "the watchdog did not answer"
            armed = table.floats[tbl.H_ARMED]
            if armed and armed <= now:
                # The deadline promised has passed: the next scope entered tells us of
                # its own. Until then a later scope does not (it is not earlier than
                # the promise), so the thread also wakes at the promise.
                table.floats[tbl.H_ARMED] = armed = 0.0
            earliest, due = table.due_slots(now)
            interrupt_due(table, due, fired, self.interrupt)
            wait = max(0.0, min(give_up, earliest, armed or give_up) - now)
            ready = _select([watched, woken], [], [], wait)[0]
            if woken in ready:
                with contextlib.suppress(OSError):
                    woken.recv(4096, socket.MSG_DONTWAIT)
            if watched in ready:
                try:
                    if watched.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT):
                        return ""  # the answer is there
                    return "the watchdog closed its connection"
                except BlockingIOError:
                    pass  # the process is reading the answer
                except OSError as exc:
                    return str(exc) or type(exc).__name__
        return ""

    def answered(self) -> bool:
        """Whether the watchdog has answered this process's hello (read if it has
        arrived; never waits)."""
        self.welcome(wait=False)
        return self.welcomed

    @property
    def watchdog_pid(self) -> int:
        """The watchdog's pid, from its answer to our hello (0 without a watchdog)."""
        self.welcome()
        return self._watchdog_pid

    def close(self) -> None:
        """Detach from the watchdog (or stop the sentinel); scopes open now are lost.

        Everything the state installed is undone: the process is left as it was
        before (a pytest session run inside a test of another ends this way)."""
        self.usable = False
        self.send_unsent_before_leaving()
        self.standby_ended = True
        self._wake_standby()
        standby = self.standby
        if standby is not None and standby.is_alive() and self.standby_socket is not None:
            # Its select returns: the connection reads end-of-file now (whether or not
            # this process has closed its own descriptor of it already).
            with contextlib.suppress(OSError):
                self.standby_socket.shutdown(socket.SHUT_RDWR)
        self._close_socket()
        atexit.unregister(self._disconnect)
        if standby is not None and standby is not threading.current_thread():
            standby.join(5.0)
        if self.standby_waker is not None:
            self.standby_waker.close()
        with self.lose_lock:  # a _lose() under way has made its sentinel by now
            sentinel = self.sentinel
        stopped = [sentinel.stop()] if sentinel is not None else []
        if self.interrupter is not None:
            stopped.append(self.interrupter.stop())
        if self.trace is not None:
            self.flush_trace()
            atexit.unregister(self.flush_trace)
        if self.dump is not None:
            startup.unregister_dump(self.dump)
            self.dump = None
        if (
            self.interrupt_sig
            and self.previous_handler is not None
            and threading.current_thread() is threading.main_thread()
        ):
            signal.signal(self.interrupt_sig, self.previous_handler)
            self.previous_handler = None
        helpers = [t for t in (standby, *stopped) if t is not None]
        if not any(t.is_alive() for t in helpers):  # none of them reads the table now
            # The mapping holds a descriptor of the table's file: both go now, not
            # whenever the last reference to this state happens to be collected.
            self.table.close()
            self.table_closed = True

    def forget_descriptors(self) -> None:
        """In a child forked from this process: close its copies of the descriptors of
        this state (the connection, the standby thread's, the interrupter's channel),
        which stay open in the parent; the threads themselves did not come along."""
        self.usable = False
        channel = self.interrupter.channel if self.interrupter is not None else None
        for sock in (
            self.sock,
            self.standby_socket,
            self.standby_waker,
            self.standby_woken,
            channel,
        ):
            if sock is not None:
                sock.close()
        self.sock = None
        self.interrupter = None

    def send_unsent_before_leaving(self) -> None:
        """Messages still waiting for the watchdog's answer (its connection was full
        before it came up) are what it needs to record expiries: wait for the answer,
        as long as :meth:`welcome` does, and send them. The plugin calls it before it
        stops the watchdog, which reads no more after that."""
        if self.unsent and self.sock is not None:
            self.welcome()
            if self.welcomed:
                self._send_unsent(wait=True)

    def _disconnect(self) -> None:
        """At the process's exit: what waits is sent, the connection closed (a child or
        an xdist worker never calls close())."""
        self.send_unsent_before_leaving()
        self._close_socket()

    def _close_socket(self) -> None:
        # Not while the standby thread sends what waited (for a while at most).
        sending = self.sending.acquire(timeout=5.0)
        try:
            sock = self.sock
            if sock is None:
                return
            # What the watchdog was not told yet, as far as the connection takes it: a
            # process that ends before the watchdog answered still gets its expiries
            # recorded (the watchdog reads a connection's messages after its end).
            with contextlib.suppress(OSError):
                while self.unsent:
                    sock.send(self.unsent[0], socket.MSG_DONTWAIT)
                    self.unsent.popleft()
            sock.close()
            self.sock = None
        finally:
            if sending:
                self.sending.release()

    def _warn(self, text: str) -> None:
        if not self.warned:
            self.warned = True
            sys.stderr.write(f"pytest-elastic-timer: {text}\n")

    # -- strings --------------------------------------------------------------------
    def sid(self, text: str) -> int:
        sid = self.sids.get(text)
        if sid is None:
            sid = self.sids[text] = self.table.add_string(text) if text else 0
        return sid

    def site(self, frame: FrameType) -> tuple[int, str]:
        """(sid of "file:line", default scope name) for the line ``frame`` is at."""
        # f_lasti is O(1); f_lineno walks the code's line table.
        key = (frame.f_code, frame.f_lineno)
        site = self.sites.get(key)
        if site is None:
            # Normalized: a module imported through a path such as src/../lib.
            filename = os.path.normpath(frame.f_code.co_filename)
            line = frame.f_lineno
            site = self.sites[key] = (
                self.sid(f"{filename}:{line}"),
                f"{os.path.basename(filename)}:{line}",
            )
        return site

    def lookup_entry(
        self,
        frame: FrameType,
        at: tuple[str, int] | None,
        parent: str,
        name: str | None,
        timed: bool = True,
    ) -> SiteEntry:
        """The :data:`SiteEntry` of a scope entered at ``frame`` (or at ``at``) below
        ``parent``: the path behind the fast cache."""
        # Entered by contextlib (ExitStack.enter_context): the site is the caller's
        # frame that asked for it. contextlib's one call site serves every such scope,
        # so it never goes into the fast cache, keyed by the frame that called it.
        if at is None:
            self.entered_scopes_of_its_own = True
        relayed = at is None and frame.f_code.co_filename == _CONTEXTLIB_FILE
        if relayed:
            frame = _user_frame(frame)
        code = frame.f_code
        key = (id(code) if at is None else at, frame.f_lasti, parent, name)
        entry = self.entries.get(key)
        if (
            entry is None
            or entry[0] is not (code if at is None else at)
            or (timed and not entry[5])
        ):
            site_sid, default_name = self.site(frame) if at is None else self.site_at(*at)
            path = self.path(parent, name or default_name)
            # The path's string is written to the table only for a scope with a slot:
            # tests' phases without a budget would add three strings per test.
            entry = (
                code if at is None else at,
                parent,
                name,
                site_sid,
                path,
                self.sid(path) if timed else 0,
                bool(code.co_flags & CO_ASYNC),
            )
            self.entries[key] = entry
        if at is None and not relayed:
            self.sites_fast[id(code) + frame.f_lasti] = entry
        return entry

    def site_at(self, filename: str, line: int) -> tuple[int, str]:
        """Like :meth:`site` for an explicit place (a test's definition)."""
        return self.sid(f"{filename}:{line}"), f"{os.path.basename(filename)}:{line}"

    def path(self, parent: str, name: str) -> str:
        key = (parent, name)
        path = self.paths.get(key)
        if path is None:
            path = self.paths[key] = f"{parent}/{name}" if parent else name
        return path

    def set_label(self, label: str) -> None:
        self.label = label
        self.table.words[tbl.H_LABEL_SID] = self.sid(label)

    def set_phase(self, phase: str) -> None:
        """What this process's pytest does from now on (``collection``, ``setup``,
        ``call``, ...): the watchdog's records name it."""
        # sid() inline for a string seen before: every test switches phases three times.
        self.table.words[tbl.H_PHASE_SID] = self.sids.get(phase) or self.sid(phase)

    def phase(self) -> str:
        """The phase :meth:`set_phase` set last ("" before that)."""
        return self.table.string(int(self.table.words[tbl.H_PHASE_SID]))

    def set_nodeid(self, nodeid: str) -> None:
        self.nodeid = nodeid
        self.nodeid_sid = self.table.words[tbl.H_TEST_SID] = self.sid(nodeid)

    def set_test(self, nodeid: str, name: str, path: str, line: int) -> None:
        """The test this process runs from now on; its one string in the table names
        the test's phase scopes too (see ``table.test_entry``)."""
        self.nodeid = nodeid
        self.nodeid_sid = self.table.add_string(tbl.test_entry(nodeid, name, path, line))
        # Also in the header: what the watchdog names a torch file-timer request of
        # this process after (it has no slot of this table).
        self.table.words[tbl.H_TEST_SID] = self.nodeid_sid

    def restore_test(self, nodeid: str, sid: int, phase: str) -> None:
        """Back to an earlier test (or none) in ``phase``, as :meth:`set_test` had
        written it."""
        self.nodeid = nodeid
        self.nodeid_sid = self.table.words[tbl.H_TEST_SID] = sid
        self.set_phase(phase)

    # -- trace --------------------------------------------------------------------
    def traced(self, path: str, start: float, thread_id: int, expired: bool) -> None:
        trace = self.trace
        assert trace is not None
        end = _monotonic()
        trace.append((path, start, end, thread_id, self.nodeid, expired))
        # Flush in batches, and soon after activity, so a process that ends with
        # os._exit (forked ranks, xdist workers) loses little.
        if len(trace) >= 256 or end - self.trace_flushed > 0.5:
            self.flush_trace()

    def flush_trace(self) -> None:
        """Append buffered trace events to this process's trace file."""
        trace = self.trace
        if not trace:
            return
        self.trace = []
        self.trace_flushed = _monotonic()
        head = {
            "pid": self.pid,
            "label": self.label,
            "worker": os.environ.get("PYTEST_XDIST_WORKER", ""),
        }
        lines = [
            unpatched.dumps(
                {**head, "path": p, "start": s, "end": e, "tid": t, "nodeid": n, "expired": x}
            )
            for p, s, e, t, n, x in trace
        ]
        with (
            contextlib.suppress(OSError),
            unpatched.open(self.trace_path, "a", encoding="utf-8") as f,
        ):
            f.write("\n".join(lines) + "\n")

    # -- slots ----------------------------------------------------------------------
    def alloc(self) -> int:
        free = self.free
        if free:
            return free.pop()
        index = self.hwm
        if index >= tbl.CAPACITY:
            raise RuntimeError(f"more than {tbl.CAPACITY} scopes open in process {self.pid}")
        self.hwm = index + 1
        self.table.words[tbl.H_HWM] = index + 1
        return index

    # -- messages -------------------------------------------------------------------
    def interrupt(self) -> None:
        """Have ScopeExpired raised wherever a scope of this process is due: its
        interrupt signal to the main thread, whose handler raises it; without one, the
        handler's work done right here, in the calling thread of the package."""
        if self.interrupt_sig:
            interrupt_main_thread(self.interrupt_sig)
        else:
            self.on_interrupt(0, None)

    def notify(self, deadline: float) -> None:
        """Tell the enforcer to wake at ``deadline``, earlier than it promised."""
        self.armed[tbl.H_ARMED] = deadline
        if self.sentinel is None and not self.welcomed:
            # A deadline needs an enforcer known to be there: the process's first one
            # waits for the watchdog's answer to its hello (the watchdog may still be
            # starting), or, in the process that started it, has a thread wait for it.
            # One that never comes up, or refuses us, leaves the sentinel.
            if self.welcome_in_background:
                self.welcome(wait=False)
                if not self.welcomed and self.before_welcome is not None:
                    self.before_welcome(deadline)
                self._stand_by()
                self._wake_standby()  # a deadline it may not know yet
            else:
                self.welcome()
        if self.sentinel is not None:
            self.sentinel.wake()
        elif self.welcomed:
            self.send("wake", at=deadline)
        elif deadline < self.wake_queued:
            # Not read yet: only an earlier one adds anything (and a watchdog slow to
            # come up does not find the connection's buffer full of them).
            self.wake_queued = deadline
            self.send("wake", at=deadline)

    def send(self, op: str, /, **fields: Any) -> None:
        if not self.welcomed:
            # A refusal (or a watchdog that never came) is learnt here at the latest,
            # and this message then goes to the in-process sentinel instead.
            self.welcome(wait=False)
        sock = self.sock
        if sock is None:
            return
        data = wire.encode(op, **fields)
        if self.welcomed and not self.unsent:
            try:
                sock.sendall(data)
            except OSError as exc:
                self._lose(str(exc))
            return
        # Not answered yet: never block on a connection nobody reads. What does not
        # fit now, and whatever follows it, waits for the answer.
        if not self.unsent:
            try:
                sock.send(data, socket.MSG_DONTWAIT)  # a datagram: all of it, or nothing
                return
            except BlockingIOError:
                pass
            except OSError as exc:
                self._lose(str(exc))
                return
        self.unsent.append(data)
        if self.welcomed:
            self._send_unsent()

    def _send_unsent(self, wait: bool = False) -> None:
        """Send the messages kept while the watchdog had not answered, in order (it
        has now: it reads them). Called where the answer is read, and by the standby
        thread once it sees the answer come. A signal handler that comes meanwhile only
        adds to them, and this loop sends those too. With ``wait``, it waits for
        another thread that sends them, and returns once they are sent."""
        if not self.sending.acquire(timeout=WELCOME_TIMEOUT if wait else 0):
            return
        failed = ""
        try:
            while self.unsent and self.sock is not None:
                self.sock.sendall(self.unsent[0])
                self.unsent.popleft()
        except OSError as exc:
            failed = str(exc) or type(exc).__name__
        finally:
            self.sending.release()
        if failed:
            self._lose(failed)

    def watchdog_alive(self, every: float = 0.0) -> bool:
        """Whether the watchdog still holds our connection (a non-blocking peek, at
        most once per ``every`` seconds). When it is gone, scopes are enforced
        in-process from now on."""
        if self.sock is None:
            return False
        now = _monotonic()
        if now - self.alive_checked < every:
            return True
        self.alive_checked = now  # also read by the plugin, to call this less often
        self.welcome(wait=False)  # a refusal or end-of-file before the answer, too
        return self._still_connected()

    def _still_connected(self) -> bool:
        sock = self.sock
        if sock is None:
            return False
        try:
            data = sock.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK)
        except BlockingIOError:
            return True
        except OSError:
            data = b""
        if data:
            return True
        self._lose("the watchdog closed its connection")
        return False

    def _lose(self, why: str) -> None:
        # Once, though the process and its standby thread may both find out.
        with self.lose_lock:
            if self.sentinel is not None or self.standby_ended:  # or close() runs
                return
            self._warn(f"lost the watchdog ({why}); enforcing scopes in-process from now on")
            self._close_socket()
            # (An interrupter ends by itself: the watchdog's end of its channel is gone.)
            self.sentinel = Sentinel(self, self.table)
            self.sentinel.wake()
        self._wake_standby()  # it ends: the sentinel enforces from now on

    def request(self, op: str, **fields: Any) -> dict[str, Any]:
        """Send ``op`` and wait for the watchdog's answer (used by the plugin only)."""
        self.welcome()
        sock = self.sock
        if sock is None:
            return {}
        try:
            _send_within(sock, wire.encode(op, **fields), 10.0)
            _, answer = wire.decode(_receive_within(sock, 10.0))
            return answer
        except (OSError, ValueError, wire.BadMessage) as exc:
            self._warn(f"lost the watchdog ({exc})")
            return {}


# Waits on the connection with select, never with a timeout on the socket: a timeout
# makes the socket's file description non-blocking for every thread that sends on it,
# and a sendall under way in another thread (the standby thread sending what waited
# for the watchdog's answer) then fails with EAGAIN, which lost the watchdog.
def _receive_within(sock: socket.socket, seconds: float) -> bytes:
    """The next message on ``sock``, waited for at most ``seconds``."""
    give_up = _monotonic() + seconds
    while True:
        try:
            return sock.recv(wire.MAX_MESSAGE, socket.MSG_DONTWAIT)
        except BlockingIOError:
            left = give_up - _monotonic()
            if left <= 0 or not _select([sock], [], [], left)[0]:
                raise TimeoutError("timed out") from None


def _send_within(sock: socket.socket, data: bytes, seconds: float) -> None:
    """Send the message ``data`` on ``sock``, waiting at most ``seconds`` for room."""
    give_up = _monotonic() + seconds
    while True:
        try:
            sock.send(data, socket.MSG_DONTWAIT)  # a datagram: all of it, or nothing
            return
        except BlockingIOError:
            left = give_up - _monotonic()
            if left <= 0 or not _select([], [sock], [], left)[1]:
                raise TimeoutError("timed out") from None


class Sentinel:
    """In-process enforcement where no watchdog is reachable: one daemon thread.

    It wakes at the earliest deadline of the table and interrupts this process
    (:meth:`ProcessState.interrupt`). It cannot stop a C call that holds the GIL, nor
    kill anything: that takes the watchdog.
    """

    def __init__(self, state: ProcessState, table: tbl.ScopeTable) -> None:
        self.state = state
        self.table = table
        self.cond = threading.Condition()
        self.woken = False
        self.fired: set[int] = set()
        self.stopped = False
        self.thread = unpatched.Thread(
            target=self._run, name=f"{THREAD_PREFIX}sentinel", daemon=True
        )
        start_helper(self.thread)

    def wake(self) -> None:
        with self.cond:
            self.woken = True
            self.cond.notify()

    def stop(self) -> threading.Thread:
        """Stop the thread and wait for it (briefly); the thread, which may still run
        if this is that very thread, or it did not end in time."""
        self.stopped = True
        self.wake()
        if self.thread is not threading.current_thread():
            self.thread.join(5.0)
        return self.thread

    def _run(self) -> None:
        floats = self.table.floats
        while not self.stopped:
            with self.cond:
                self.woken = False
            now = _monotonic()
            floats[tbl.H_ARMED] = 0.0  # until this look is done, every entry wakes us
            earliest, due = self.table.due_slots(now)
            # Outside the lock: a delivery may find the watchdog lost, whose handling
            # wakes this thread.
            interrupt_due(self.table, due, self.fired, self.state.interrupt)
            floats[tbl.H_ARMED] = earliest
            # At most an hour: a wait for a budget of centuries overflows the clock's
            # type (OverflowError), and would end this thread.
            timeout = None if earliest == float("inf") else max(0.0, min(earliest - now, 3600.0))
            with self.cond:
                if not self.woken and not self.stopped:
                    self.cond.wait(timeout)


class Interrupter:
    """The interrupt of a process that has no interrupt signal: one daemon thread.

    ``signal.signal()`` works only in the main thread, so a process whose first scope
    is entered in another one (a pytest run in a thread; an xdist worker that
    execnet's socket server runs in a thread of its own) has no handler for the
    watchdog to signal. It sends the watchdog one end of a socket pair with its hello
    instead; the watchdog writes a byte on it where its ladder would send the signal
    (after asking the processes below for their stacks), and this thread, waiting on
    the other end, does the handler's work (:meth:`ProcessState.interrupt`). The
    exceptions reach their threads asynchronously: Python code gets one at its next
    bytecode, a call blocked in C when it returns. The thread ends when the watchdog
    closes its end (it refused the process, or went away) or at :meth:`stop`.
    """

    def __init__(self, state: ProcessState, channel: socket.socket) -> None:
        self.state = state
        self.channel = channel
        self.thread = unpatched.Thread(
            target=self._run, name=f"{THREAD_PREFIX}interrupter", daemon=True
        )
        start_helper(self.thread)

    def stop(self) -> threading.Thread:
        """End the thread and wait for it (briefly); the thread, which may still run if
        this is that very thread, or it did not end in time."""
        with contextlib.suppress(OSError):  # its recv returns end-of-file now
            self.channel.shutdown(socket.SHUT_RDWR)
        if self.thread is not threading.current_thread():
            self.thread.join(5.0)
        if not self.thread.is_alive():
            self.channel.close()
        return self.thread

    def _run(self) -> None:
        while True:
            try:
                if not self.channel.recv(64):
                    return
            except OSError:
                return
            self.state.interrupt()  # one look delivers every scope that is due


def interrupt_due(
    table: tbl.ScopeTable,
    due: list[tbl.SlotView],
    fired: set[int],
    interrupt: Callable[[], None],
) -> None:
    """Call ``interrupt`` (the process's, :meth:`ProcessState.interrupt`) for each slot
    of ``due`` not interrupted yet (``fired`` keeps their serials), unless a debugger
    holds the table's deadlines: in-process enforcement, by the sentinel or the standby
    thread (the table may be one the process state does not hold yet)."""
    if table.floats[tbl.H_SUSPENDED]:
        return
    for slot in due:
        if slot.serial not in fired:
            fired.add(slot.serial)
            interrupt()


def scale_from_env() -> float:
    """The session's scale factor as the environment gives it (``ENV_SCALE``), for a
    process that has no word from the watchdog; 1.0 without one. ValueError naming the
    value if it is not a finite number above 0 (as ``--elastic-timer-scale`` must be)."""
    text = os.environ.get(ENV_SCALE, "")
    if not text:
        return 1.0
    try:
        scale = float(text)
    except ValueError:
        scale = math.nan
    if not 0 < scale < math.inf:
        raise ValueError(f"{ENV_SCALE} must be a finite number above 0, not {text!r}")
    return scale
