"""What the ranks were doing: the records of expired scopes amended from the rings.

Every process of the session that uses torch.distributed keeps a ring of its recent
ops in the session directory (``core/collectives.py``). Before a record is kept and
written, :class:`CollectivesAmender` reads the rings of the record's owner and of its
children, and of the other ranks of their world, as they stood at the deadline, and
adds the ``collective`` field; a child that called ``init_process_group`` gets its
``rank N`` label from its ring, whether or not ``RANK`` was in its environment.
The rings outlive their processes, so this works after the ladder ended them, and for
the record of a rank that was killed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pytest_elastic_timer.core.records import ExpiryRecord


class CollectivesAmender:
    """A :class:`~pytest_elastic_timer.watchdog.recorder.Recorder` amender for the
    session ``directory``. ``ended``: when the watchdog knows processes of the session
    to have ended (pid -> its clock), so that a rank that ended inside an op before the
    deadline is told apart from one still waiting in it."""

    def __init__(self, directory: str, ended: Callable[[], Mapping[int, float]]) -> None:
        self.directory = directory
        self.ended = ended

    def __call__(self, record: ExpiryRecord) -> None:
        if record.host:
            return  # another host's processes: their rings are on that host
        # Loaded with the first record: the watchdog of a session in which nothing
        # expires never reads a ring, and comes up sooner without it.
        from pytest_elastic_timer.core import collectives

        pids = [record.pid, *(int(c["pid"]) for c in record.children if "pid" in c)]
        labels = collectives.labels(
            self.directory, [*pids, *(int(p["pid"]) for p in record.peers if "pid" in p)]
        )
        for child in [*record.children, *record.peers]:
            label = labels.get(int(child.get("pid", 0)))
            if label:  # the rank's own word beats RANK in its environment
                child["label"] = label
        if not record.label and labels.get(record.pid):
            record.label = labels[record.pid]
        ended = self.ended()
        gone = {pid for pid, when in ended.items() if when <= record.deadline}
        # Running at the deadline: the owner and the processes whose stacks were asked
        # for then (every live one below it and of its world), and those that ended
        # after it. Any other rank whose process is gone had ended before it.
        running = {
            *pids,
            *(int(p["pid"]) for p in record.peers if "pid" in p),
            *(pid for pid, when in ended.items() if when > record.deadline),
        }
        found = collectives.collective_for(
            self.directory, pids, record.deadline, gone, running=running
        )
        if found is not None:
            record.collective = found
