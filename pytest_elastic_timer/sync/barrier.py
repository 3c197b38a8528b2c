"""Barriers, in the watchdog: rounds of ``parties`` calls under one name.

A round passes when its last party arrives; it times out at the first deadline of its
waiters, and then every waiter is answered at once with who arrived and who is missing.
A timed-out round is over: the next call of the name begins a new round.
"""

from __future__ import annotations

import socket
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from pytest_elastic_timer.core import wire
from pytest_elastic_timer.sync.protocol import ERROR, MAX_PARTIES, OK
from pytest_elastic_timer.sync.waiters import Party, Waiter, Waits, name_of, names
from pytest_elastic_timer.watchdog.host import Identity


@dataclass
class BarrierState:
    parties: int = 0
    generation: int = 0  # the round now gathering
    waiting: list[Waiter] = field(default_factory=list)
    left: list[Party] = field(default_factory=list)  # arrived, then went away
    # Who took part in the last round that ended, and how it ended: the best guess at
    # who is missing when a round times out.
    last: list[tuple[Party, Identity | None]] = field(default_factory=list)
    last_outcome: str = ""
    last_ended: float = 0.0


class Barriers:
    """Every barrier of the session, by name."""

    def __init__(self, waits: Waits) -> None:
        self.waits = waits
        self.barriers: dict[str, BarrierState] = {}

    def wait(self, conn: socket.socket, peer_pid: int, fields: dict[str, Any]) -> None:
        waits = self.waits
        name = waits.blocking_call(conn, fields)
        parties = wire.field(fields, "parties", int)
        if not 1 <= parties <= MAX_PARTIES:
            raise ValueError(f"parties must be between 1 and {MAX_PARTIES}, not {parties}")
        barrier = self.barriers.setdefault(name, BarrierState())
        if barrier.waiting and barrier.parties != parties:
            waits.host.send(
                conn,
                ERROR,
                error=(
                    f"barrier {name!r} is gathering {barrier.parties} parties in round "
                    f"{barrier.generation} ({len(barrier.waiting)} arrived); this call says "
                    f"{parties}"
                ),
            )
            return
        waiter = waits.waiter(conn, peer_pid, fields)
        barrier.parties = parties
        barrier.waiting.append(waiter)
        waits.calls[conn] = ("barrier", name, waiter)
        if len(barrier.waiting) >= parties:
            self._pass(name, barrier)
            return
        generation = barrier.generation
        waits.later(waiter.deadline, lambda: self._due(name, barrier, generation))

    def left(self, name: str, waiter: Waiter) -> None:
        """``waiter`` went away (its call was interrupted, or its process died)."""
        barrier = self.barriers[name]
        if waiter in barrier.waiting:
            barrier.waiting.remove(waiter)
            barrier.left.append(self.waits.party(waiter, self.waits.now()))

    def _pass(self, name: str, barrier: BarrierState) -> None:
        waits = self.waits
        now = waits.now()
        generation = barrier.generation
        waits.count("barrier", name, "rounds", parties=barrier.parties)
        for index, waiter in enumerate(barrier.waiting):
            waits.calls.pop(waiter.conn, None)
            waits.host.send(
                waiter.conn, OK, index=index, generation=generation, budget=waiter.budget
            )
        self._end_round(barrier, "passed", now)

    def _end_round(self, barrier: BarrierState, outcome: str, now: float) -> None:
        barrier.last = [(self.waits.party(w, now), w.ident) for w in barrier.waiting]
        barrier.last_outcome = f"{outcome} round {barrier.generation}"
        barrier.last_ended = now
        barrier.generation += 1
        barrier.waiting = []
        barrier.left = []

    def _due(self, name: str, barrier: BarrierState, generation: int) -> None:
        if barrier.generation != generation or not barrier.waiting:
            return  # that round passed, or timed out already
        waits = self.waits
        now = waits.now()
        if min(w.deadline for w in barrier.waiting) > now:
            return  # the waiter that set this timer left; another timer is due later
        arrived = [waits.party(w, now) for w in barrier.waiting]
        missing = self._missing(name, barrier, now)
        detail = (
            f"{len(arrived)} of {barrier.parties} parties arrived in round {generation}: "
            f"{names(arrived)}; missing: {_missing_text(missing, barrier.parties)}"
        )
        waits.count("barrier", name, "timeouts", parties=barrier.parties)
        for waiter in barrier.waiting:
            waits.time_out(
                waiter,
                f"barrier:{name}",
                detail,
                now,
                arrived=arrived,
                missing=missing,
                parties=barrier.parties,
                generation=generation,
            )
        self._end_round(barrier, "timed out in", now)

    def _missing(self, name: str, barrier: BarrierState, now: float) -> list[Party]:
        """Who the round waits for: those that left it, those that took part in the
        last round but not in this one, and as many as remain that never arrived."""
        needed = barrier.parties - len(barrier.waiting)
        here = Counter(w.pid for w in barrier.waiting)
        left: list[Party] = []
        for party in barrier.left:
            if here[party["pid"]]:
                here[party["pid"]] -= 1  # it came back
                continue
            note = "arrived, then went away (its call was interrupted or its process ended)"
            left.append({**party, "note": note})
        alive: list[Party] = []
        dead: list[Party] = []
        if len(barrier.last) == barrier.parties:  # the same use of the name, most likely
            ago = now - barrier.last_ended
            for party, ident in barrier.last:
                if here[party["pid"]]:
                    here[party["pid"]] -= 1
                    continue
                note = f"{barrier.last_outcome} {ago:.2f}s ago"
                if ident is None or not ident.alive():
                    dead.append({**party, "note": f"{note}; its process has ended"})
                else:
                    doing = self.waits.activity(party["pid"], ("barrier", name))
                    alive.append({**party, "note": f"{note}; {doing}" if doing else note})
        named = (left + alive + dead)[:needed]
        unknown = {"pid": 0, "label": "", "site": "", "worker": "", "note": "never arrived"}
        return named + [dict(unknown) for _ in range(needed - len(named))]


def _missing_text(missing: list[Party], parties: int) -> str:
    named = [f"{name_of(p)}: {p['note']}" for p in missing if p.get("pid")]
    unknown = len(missing) - len(named)
    if unknown:
        named.append(f"{unknown} {'party' if unknown == 1 else 'parties'} never arrived")
    return f"{'; '.join(named)} ({len(missing)} of {parties} parties missing)"
