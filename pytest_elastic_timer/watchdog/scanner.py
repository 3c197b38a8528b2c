"""Where deadlines are enforced: scans of the owners' tables, and the ladders they start.

A scan of a table (see the "armed" protocol in docs/design.md) sets ``ARMED = 0``, so
that every scope entered meanwhile sends a ``wake``; reads every open slot; starts the
ladder of each scope past its deadline, outermost first and one per thread; writes
``ARMED`` = the earliest remaining deadline, and sets a timer for it. A scope whose
deadline is more than 50 ms away also gets a second look 50 ms after the scan, in case
a slot stored just before the scan was not yet visible to it (memory ordering).
"""

from __future__ import annotations

import inspect
from typing import Any

from pytest_elastic_timer.core import table as tbl
from pytest_elastic_timer.core import wire
from pytest_elastic_timer.watchdog import proctree
from pytest_elastic_timer.watchdog.ladder import CHECK_EVERY, Ladder, closed
from pytest_elastic_timer.watchdog.loop import Loop
from pytest_elastic_timer.watchdog.owners import Expiry, Owner, Owners

RECHECK_AFTER = 0.05  # second look after a scan, in case a slot store was not yet visible


class Scanner:
    """Finds scopes past their deadline and advances their ladders on the loop."""

    def __init__(self, loop: Loop, owners: Owners, ladder: Ladder, grace: float) -> None:
        self.loop = loop
        self.owners = owners
        self.ladder = ladder
        self.grace = grace  # for a scope that has no grace of its own

    def schedule_scan(self, owner: Owner, at: float, *, recheck: bool = True) -> None:
        """Scan ``owner``'s table at ``at`` (unless a scan comes sooner)."""
        if at >= owner.next_scan:
            return
        owner.next_scan = at
        self.loop.call_at(at, lambda: self.scan(owner, recheck=recheck))

    def scan(self, owner: Owner, *, recheck: bool = True) -> None:
        """Look at every open scope of ``owner``; escalate those past their deadline."""
        if not self.owners.is_current(owner):
            return
        now = self.loop.clock()
        owner.next_scan = float("inf")
        running = bool(proctree.alive([owner.proc]))
        if running:
            owner.seen_alive = now
        # A process that ended (killed, os._exit, or gone with a scope acquired and never
        # released) expired only the scopes whose deadline passed while it ran.
        until = now if running else owner.seen_alive
        table = owner.table
        table.floats[tbl.H_ARMED] = 0.0  # until this scan is done, every entry notifies
        suspended = table.floats[tbl.H_SUSPENDED]
        earliest, due = table.due_slots(until)
        # A thread whose scope is escalating (and still open) is not interrupted again
        # for the scopes it encloses. One whose scope has closed, while its ladder still
        # collects evidence (children's dumps), is free for its next deadline.
        busy_threads = {e.thread_id for e in owner.expiries.values() if not closed(owner, e)}
        held_back = False
        for slot in sorted(due, key=lambda s: s.depth):  # outermost first
            if suspended or slot.serial in owner.expiries or slot.serial in owner.finished:
                continue
            if slot.thread_id in busy_threads:
                held_back = True  # looked at again once that escalation is over
                continue
            busy_threads.add(slot.thread_id)
            self._expire(owner, slot)
        table.floats[tbl.H_ARMED] = earliest
        if not running:
            return  # nothing more of it can expire
        if earliest < float("inf"):
            self.schedule_scan(owner, earliest)
        if held_back:
            self.schedule_scan(owner, now + CHECK_EVERY)
        if recheck and earliest > now + RECHECK_AFTER:
            self.schedule_scan(owner, now + RECHECK_AFTER, recheck=False)

    def _expire(self, owner: Owner, slot: tbl.SlotView) -> None:
        # A second, separate read: the scan's copy of the table has no load order, so
        # only act on a slot that still holds this entry and is still past its deadline.
        again = owner.table.read_slot(slot.slot_index)
        if again is None or again.serial != slot.serial or again.deadline > self.loop.clock():
            if again is not None:
                self.schedule_scan(owner, again.deadline)
            return
        slot = again
        path, site, nodeid = owner.table.scope_of(slot)
        expiry = Expiry(
            slot=slot.slot_index,
            serial=slot.serial,
            path=path,
            site=site,
            nodeid=nodeid,
            start=slot.start,
            deadline=slot.deadline,
            grace=slot.grace if slot.grace > 0 else self.grace,
            thread_id=slot.thread_id,
            phase=owner.phase(),
            flags=slot.flags,
        )
        owner.expiries[slot.serial] = expiry
        expiry.steps = self.ladder.steps(owner, expiry)
        self.advance(owner, expiry)

    def reported(self, owner: Owner, fields: dict[str, Any]) -> None:
        """The owner raised ScopeExpired and says where it was."""
        serial = wire.field(fields, "serial", int)
        for name in ("budget", "elapsed"):  # checked now: a record is built from them later
            if name in fields:
                wire.field(fields, name, (int, float))
        expiry = owner.expiries.get(serial)
        if expiry is not None:
            expiry.report = fields
            # Recorded now, so a report made before the scope closes lists it; a later
            # escalation writes a record that supersedes this one.
            stack = expiry.reported_stack()
            self.ladder.record(owner, expiry, "interrupted", stack, [], final=False)
        elif serial not in owner.finished:
            # An expiry the owner noticed first (at scope exit, or before our scan):
            # record it without interrupting again. A scope still open (the exception
            # raised in another thread waits for its thread to run Python again) is
            # watched like any other: ended with its owner if it is still open when its
            # grace is over.
            now = self.loop.clock()
            slot = next((s for s in owner.table.due_slots(now)[1] if s.serial == serial), None)
            expiry = Expiry(
                slot=-1 if slot is None else slot.slot_index,
                serial=serial,
                path=str(fields.get("scope", "")),
                site=str(fields.get("site", "")),
                nodeid=str(fields.get("nodeid", "")),
                start=0.0 if slot is None else slot.start,
                deadline=now if slot is None else slot.deadline,
                grace=slot.grace if slot is not None and slot.grace > 0 else self.grace,
                thread_id=0 if slot is None else slot.thread_id,
                phase=owner.phase(),
                report=fields,
            )
            owner.expiries[serial] = expiry
            # On disk at once: a record must not wait for the ladder's next step.
            stack = expiry.reported_stack()
            self.ladder.record(owner, expiry, "interrupted", stack, [], final=False)
            # Still open: the children's stacks at the expiry, as for one we interrupt.
            expiry.steps = self.ladder.steps(owner, expiry, interrupt=False, dumps=slot is not None)
            self.advance(owner, expiry)

    def advance(self, owner: Owner, expiry: Expiry) -> None:
        """Run the next step of ``expiry``'s ladder; set a timer for the one after."""
        assert expiry.steps is not None
        if inspect.getgeneratorstate(expiry.steps) == inspect.GEN_RUNNING:
            # The ladder reads its owner's connection for a report in flight; a "sync"
            # read there asks to advance the very ladder that is running. It goes on
            # by itself once the read is done.
            return
        try:
            delay = next(expiry.steps)
        except StopIteration:
            return
        except Exception as exc:
            if expiry.plain:
                raise  # the plain ladder failed too: the loop reports it
            # A defect in what only adds to the record (the stacks of the processes
            # below the owner and of its ranks, their collectives) must not leave the
            # scope unenforced: the escalation goes on without them.
            self.loop.report_error(exc, f"a step of the escalation of scope {expiry.path!r}")
            expiry.plain = True
            expiry.read_children = expiry.read_peers = None
            expiry.steps = self.ladder.steps(
                owner, expiry, interrupt=not expiry.interrupted, dumps=False
            )
            delay = 0.0
        self.loop.call_at(self.loop.clock() + delay, lambda: self.advance(owner, expiry))

    def settle(self) -> None:
        """Advance every escalation whose scope has closed (before reporting)."""
        for owner in self.owners.everyone():
            for expiry in list(owner.expiries.values()):
                if closed(owner, expiry):
                    self.advance(owner, expiry)

    def pending(self) -> list[tuple[Owner, Expiry]]:
        """Every escalation still running."""
        return [(o, e) for o in self.owners.everyone() for e in o.expiries.values()]
