"""The escalation ladder, for one expired scope:

1. interrupt -- the owner's interrupt signal raises ``ScopeExpired`` in the owning thread
   (once every process below the owner has dumped its stacks: once the owner is
   interrupted, harnesses tear their ranks down and the evidence is gone; the dumps are
   read afterwards);
2. dump      -- after the grace period, faulthandler dumps every thread of the owner;
3. terminate -- SIGTERM (and SIGCONT) to the owner's process tree, children first,
   SIGKILL to what survives ``kill_after``; for an adopted owner (a torch file-timer
   client), the signal its request named instead of SIGTERM, or, for a signal of 0 or
   below, nothing: torch leaves such a process running, and so does this. An owner
   asleep (waiting, most likely for the processes it started) has those ended first,
   is interrupted again, and gets a moment to end the scope itself before its turn;
4. record    -- one record per scope (:mod:`.recorder`).

The ladder is a generator: each ``yield`` is the delay until its next step, and the
watchdog's loop advances every running ladder through its timer heap, so one stuck
process never delays another's escalation and a test can drive a ladder step by step.
A scope that closes at any step (the owner unwound, or died) ends its ladder there.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Generator
from typing import Any

import psutil

from pytest_elastic_timer.core import records
from pytest_elastic_timer.core import table as tbl
from pytest_elastic_timer.watchdog import proctree
from pytest_elastic_timer.watchdog.dumps import Dumper
from pytest_elastic_timer.watchdog.loop import Clock
from pytest_elastic_timer.watchdog.owners import Expiry, Owner
from pytest_elastic_timer.watchdog.recorder import Recorder

CHECK_EVERY = 0.01  # how often a scope in its grace period is looked at
GONE_CHECK = 0.02  # how often a signalled tree is looked at
KILLED_PATIENCE = 2.0  # how long SIGKILLed processes may take to go
# How long the report of an interrupt given on the owner's channel may follow the
# scope's end: the owner sends it after the (asynchronous) exception, not before.
REPORT_PATIENCE = 1.0
# How long an owner that was waiting has, once the processes below it are ended, to end
# its expired scope itself (at most its grace).
OWNER_AFTER_CHILDREN = 1.0


class Ladder:
    """Runs the ladder of each expired scope; its steps are generators of delays."""

    def __init__(
        self,
        *,
        clock: Clock,
        dumper: Dumper,
        recorder: Recorder,
        kill_after: float,
        root_pid: int,
        read_pending: Callable[[Owner], None],
        ending_root: Callable[[], None],
        peers_of: Callable[[Owner], list[int]] = lambda owner: [],
        on_error: Callable[[Exception, str], None] | None = None,
    ) -> None:
        self.clock = clock
        self.dumper = dumper
        self.recorder = recorder
        self.kill_after = kill_after
        self.root_pid = root_pid  # the pytest process (0 for another host's watchdog: none)
        self.read_pending = read_pending  # reads what a connected owner sent, unread yet
        self.ending_root = ending_root  # about to end pytest: report now, not after
        self.peers_of = peers_of  # the other ranks of an owner's world (their pids)
        # Says a defect in a step that only adds to a record, which is then left out.
        self.on_error = on_error

    def steps(
        self, owner: Owner, expiry: Expiry, *, interrupt: bool = True, dumps: bool | None = None
    ) -> Generator[float, None, None]:
        """The ladder of ``expiry``; without ``interrupt`` the owner was not signalled
        (it raised by itself and said so). ``dumps``: whether the processes below the
        owner are asked for their stacks first (by default, where it is interrupted)."""
        table = owner.table
        asked = None
        with_dumps = interrupt if dumps is None else dumps
        if with_dumps:
            asked = self.dumper.ask_descendants(owner)
            if asked:
                expiry.read_children = asked.children
                yield from self.dumper.written(asked)
        interruptible = owner.interruptible()
        if interrupt:
            expiry.by_channel = not table.words[tbl.H_INTERRUPT_SIG] and interruptible
            owner.interrupt()
            expiry.interrupted = True
        # (Also for the plain ladder that goes on after a failed step: see Scanner.)
        by_channel = expiry.by_channel
        if with_dumps:
            # The other ranks of its world once it is interrupted: finding them reads
            # the rings, which must not hold the interrupt back.
            below = {d.pid for d in asked.dumps} if asked else set()
            peers = self.dumper.ask_peers(owner, self.peers_of(owner), below)
            if peers:
                expiry.read_peers = peers.peers
                yield from self.dumper.finished(peers)
        if asked:
            yield from self.dumper.finished(asked)
        # Without an interrupt to give the owner, there is nothing to wait for.
        grace_end = expiry.deadline + (expiry.grace if interruptible else 0.0)
        report_due: float | None = None
        while True:
            if closed(owner, expiry):
                if by_channel and not self._reported(owner, expiry):
                    # Its report may be on its way yet; a scope that an enclosing
                    # one's exception unwound has none, and is let go after a while.
                    now = self.clock()
                    report_due = report_due or now + REPORT_PATIENCE
                    if now < report_due and proctree.alive([owner.proc]):
                        yield CHECK_EVERY
                        continue
                self._closed(owner, expiry)
                return
            now = self.clock()
            if table.floats[tbl.H_SUSPENDED]:  # a debugger holds the owner: so is the grace
                grace_end = max(grace_end, now + expiry.grace)
            if now >= grace_end:
                break
            yield min(CHECK_EVERY, grace_end - now)
        try:
            stack = yield from self.dumper.owner(owner)
        except Exception as exc:
            if not expiry.plain:
                raise  # the plain ladder goes on (Scanner.advance)
            self._failed(exc, f"the stacks of the owner of scope {expiry.path!r}")
            stack = ""
        stack = stack or expiry.reported_stack()
        yield from self._terminate(owner, expiry, stack)

    def _reported(self, owner: Owner, expiry: Expiry) -> bool:
        """Whether the owner's report of ``expiry`` is here (read if it is in flight)."""
        if expiry.report is None and not expiry.recorded:
            self.read_pending(owner)
        return expiry.report is not None or expiry.recorded

    def _closed(
        self,
        owner: Owner,
        expiry: Expiry,
        stack: str = "",
        ended: list[dict[str, Any]] | None = None,
    ) -> None:
        """The scope is closed: its record, ``interrupted``. ``ended``: the processes
        below the owner the ladder ended first (:meth:`_terminate`), which the record
        lists, in place of the one the owner's report made, and which make a record
        also of a scope an enclosing one unwound; ``stack``: the owner's, if dumped."""
        self.read_pending(owner)  # its report may be in flight
        if expiry.recorded and not ended:  # the record its report made stands
            forget(owner, expiry)
        elif expiry.report is not None or ended or not proctree.alive([owner.proc]):
            self.record(owner, expiry, "interrupted", stack or expiry.reported_stack(), ended or [])
        else:
            forget(owner, expiry)  # unwound by an enclosing scope: no record of its own

    def _terminate(self, owner: Owner, expiry: Expiry, stack: str) -> Generator[float, None, None]:
        # Only the watchdog writes an adopted owner's table: its slots' flags say how a
        # torch request asked its process to end. A registered owner's never count (nor
        # when its connection closed: its table is still its own).
        signum = tbl.end_signal(expiry.flags) if owner.adopted else 0
        if signum is None:
            self.record(owner, expiry, "reported", stack, [])
            return
        # Zombies left out: nothing to end, and nothing the owner runs now.
        tree = proctree.alive(proctree.tree_of(owner.proc, {os.getpid()}))
        if not tree:  # gone by itself since the last look (its parent ended it, say)
            self._closed(owner, expiry, stack)
            return
        below = [p for p in tree if p.pid != owner.pid]
        if not expiry.children:
            expiry.children = [proctree.describe(p) for p in below]
        ended_first: list[dict[str, Any]] = []
        patience = min(expiry.grace, OWNER_AFTER_CHILDREN)
        waited_for = [
            p for p in below if not proctree.is_multiprocessing_service(proctree.cmdline_of(p))
        ]
        if not signum and waited_for and patience > 0 and proctree.waiting(owner.proc):
            # Interrupted, and asleep all the same: it waits, most likely for the
            # processes it started (ranks it joins one by one: multiprocessing takes
            # the ScopeExpired in waitpid for an OSError, and joins the next). Those
            # end first; the owner, woken and interrupted again, may still end its
            # test itself, and its session goes on.
            ended_first = [proctree.describe(p) for p in waited_for]
            yield from self._end(waited_for, signal.SIGTERM)
            owner.interrupt()
            give_up = self.clock() + patience
            while not closed(owner, expiry) and self.clock() < give_up:
                yield CHECK_EVERY
            if closed(owner, expiry):
                self._closed(owner, expiry, stack, ended_first)
                return
            tree = proctree.alive(proctree.tree_of(owner.proc, {os.getpid()}))
        ended = ended_first + [proctree.describe(p) for p in tree]
        if owner.pid == self.root_pid:
            # Ending pytest itself: whoever waits for it must find the report and the
            # summary the moment it is gone, so they come first (and again, final, later).
            self.record(owner, expiry, "terminated", stack, ended, final=False)
            self.ending_root()
        killed = yield from self._end(tree, signum or signal.SIGTERM)
        action = "killed" if signum == signal.SIGKILL or owner.proc in killed else "terminated"
        unkillable = [proctree.describe(p) for p in proctree.alive(tree)]
        record = self.record(owner, expiry, action, stack, ended)
        if unkillable:
            record.stack += f"\n(still alive after SIGKILL: {unkillable})"

    def _end(
        self, tree: list[psutil.Process], signum: int
    ) -> Generator[float, None, list[psutil.Process]]:
        """``signum`` to ``tree``, SIGKILL to what survives ``kill_after``: returns the
        processes that had to be killed."""
        proctree.send(tree, signum)
        proctree.send(tree, signal.SIGCONT)  # a stopped process acts on SIGTERM once it runs
        give_up = self.clock() + self.kill_after
        while proctree.alive(tree) and self.clock() < give_up:
            yield GONE_CHECK
        survivors = proctree.alive(tree)
        if survivors:
            proctree.send(survivors, signal.SIGKILL)
            give_up = self.clock() + KILLED_PATIENCE
            while proctree.alive(survivors) and self.clock() < give_up:
                yield GONE_CHECK
        return survivors

    def record(
        self,
        owner: Owner,
        expiry: Expiry,
        action: str,
        stack: str,
        ended: list[dict[str, Any]],
        *,
        final: bool = True,
    ) -> records.ExpiryRecord:
        """Record ``expiry``; a final record ends its escalation, an early one is
        superseded by a later record of the same scope."""
        if final:
            forget(owner, expiry)
        else:
            expiry.recorded = True
        try:
            if expiry.read_children is not None:
                expiry.children = expiry.read_children()
            if expiry.read_peers is not None:
                expiry.peers = expiry.read_peers()
        except Exception as exc:  # the record is kept without them
            self._failed(exc, f"the stacks of the processes around scope {expiry.path!r}")
        return self.recorder.expired(owner, expiry, action, stack, ended)

    def _failed(self, exc: Exception, what: str) -> None:
        if self.on_error is None:
            raise exc
        self.on_error(exc, what)


def closed(owner: Owner, expiry: Expiry) -> bool:
    """Whether the scope of ``expiry`` is no longer open (or its owner is gone)."""
    if expiry.slot < 0:
        return True
    slot = owner.table.read_slot(expiry.slot)
    return slot is None or slot.serial != expiry.serial or not proctree.alive([owner.proc])


def forget(owner: Owner, expiry: Expiry) -> None:
    """End the escalation of ``expiry``: the scope is never escalated again."""
    owner.expiries.pop(expiry.serial, None)
    owner.finished.add(expiry.serial)
