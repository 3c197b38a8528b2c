"""The session's state, kept in ``config.stash`` under :data:`SESSION`, and the facts
derived from it that several parts of the plugin read."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import pytest

from pytest_elastic_timer.core import unpatched
from pytest_elastic_timer.plugin import launcher, leaks
from pytest_elastic_timer.plugin.budgets import BudgetBook
from pytest_elastic_timer.plugin.options import Settings
from pytest_elastic_timer.plugin.torch_timer_file import TorchTimerFile
from pytest_elastic_timer.scope import scopes
from pytest_elastic_timer.scope.scopes import ScopeExpired, TimerRequest

if TYPE_CHECKING:
    # Loaded where a record is read or shown: a session outside xdist in which no test
    # failed never loads the records (nor the stacks) module.
    from pytest_elastic_timer.core import records


class SessionState:
    """What the plugin knows of its session, in one process (controller, worker, or
    the only one)."""

    # A plain class, not a dataclass: defining one costs every session's start-up.
    def __init__(
        self,
        settings: Settings,
        budgets: BudgetBook,
        *,
        rootdir: str = "",
        ends_with_its_process: bool = False,
        has_no_session_of_its_own: bool = False,
    ) -> None:
        self.settings = settings
        self.budgets = budgets
        self.rootdir = rootdir
        # The command line's own session: its process ends with it (see lifecycle).
        self.ends_with_its_process = ends_with_its_process
        # Configured inside another session with none of its own (pytester's getitem()
        # and the like): it leaves the process to that session.
        self.has_no_session_of_its_own = has_no_session_of_its_own
        self.watchdog: launcher.WatchdogHandle | None = None
        # The session put the finder on sys.meta_path that waits for torch.distributed
        # (core/torch_hook.py): it takes it away at its end.
        self.watching_torch = False
        # A session run in-process by a test whose watchdog is to start only once a
        # test needs it (see lifecycle.defer_watchdog); False once it started.
        self.watchdog_on_demand = False
        self.previous_env: dict[str, str | None] = {}
        self.children_before: set[int] = set()  # this process's, at start
        self.session_scope: TimerRequest | None = None
        self.stop_reason = ""  # why the session stopped, if its budget ran out
        # The same, where it ran out in an xdist worker at the worker's very end, after
        # its results (controller): the summary's first line says it.
        self.stopped_at_a_worker_end = ""
        # The plugin's own terminal summary was written (see SessionHooksBudget).
        self.summary_written = False
        # (nodeid, phase) of the test the session's budget stopped (not in a worker).
        self.interrupted_test: tuple[str, str] | None = None
        # An xdist worker's session budget that ran out after a test's setup, while
        # its report was made: the test's call fails by it (see lifecycle).
        self.expired_before_the_call: ScopeExpired | None = None
        # The watchdog's torch file-timer FIFO, which a test's torch agent may take over.
        self.torch_timer_file: TorchTimerFile | None = None
        self.session: pytest.Session | None = None
        self.lost_watchdog = ""  # why and when the watchdog went away mid-session
        # The host's name where this worker runs on a host other than the controller's
        # ("" at home): pids it names are that host's.
        self.other_host = ""
        self.expiry_listener: Callable[[], None] | None = None
        # Absolute file of each location path items report, relative to rootdir.
        self.files: dict[str, str] = {}
        self.started = unpatched.now()
        self.exitstatus: int | None = None
        # What leaves the process as the session found it (a pytest run inside a test).
        self.put_back_scopes: Callable[[], None] = _nothing
        self.put_back_naming: Callable[[], None] = _nothing
        self.leak_watch: leaks.Watch | None = None  # None: no session runs (--help)
        self.adopts_orphans = False  # from the end of collection on (warn, kill)
        # Whether the session uses the plugin (see uses_plugin); once True, it stays.
        self.used = False
        # Failed tests and the expired scopes that failed them (controller or only
        # process).
        self.expired: dict[str, list[records.ExpiryRecord]] = {}

    def file_of(self, path: str) -> str:
        """The absolute file of an item's location ``path`` (relative to rootdir, unless
        pytest gave an absolute one), cached by path."""
        file = self.files.get(path)
        if file is None:
            # Normalized: a test outside rootdir has a location such as ../x/test_a.py.
            file = self.files[path] = os.path.normpath(
                path if path.startswith("/") else f"{self.rootdir}/{path}"
            )
        return file

    def lose_watchdog(self, why: str) -> None:
        """Add ``why`` to what :attr:`lost_watchdog` says: a session may lose its own
        watchdog and those of other hosts."""
        if why not in self.lost_watchdog:
            self.lost_watchdog = f"{self.lost_watchdog}; {why}" if self.lost_watchdog else why

    def ended_worker_patience(self) -> float:
        """How long the controller waits on what a worker that went down leaves behind
        (the record of its ending, its host's socket server): the grace, within which
        its escalation ends, and 5 s more."""
        return self.settings.grace + 5.0

    def watchdog_named(self, pid: int) -> str:
        """``the watchdog (pid N)``, with the host on another host, whose pid it is."""
        host = f", host {self.other_host}" if self.other_host else ""
        return f"the watchdog (pid {pid}{host})"

    def watchdog_died(self, pid: int) -> None:
        """The watchdog ``pid`` was found gone at the session's end."""
        self.lose_watchdog(
            f"{self.watchdog_named(pid)} died during the session; scopes were enforced "
            "in-process from then on"
        )

    def uses_plugin(self) -> bool:
        """Whether the session uses the plugin so far: one of its options given (see
        ``used``), a test of this process with an ``expires`` marker, or a scope
        entered by code of this process. A session that does not is left untouched by
        the default leak check (``auto``)."""
        if not self.used:
            process = scopes.current_state()
            self.used = self.budgets.has_markers or (
                process is not None and process.entered_scopes_of_its_own
            )
        return self.used

    def watch_for_leaks(self) -> None:
        """Before a test's call phase: under ``auto``, adopt orphaned descendants from
        the first test on which the session uses the plugin."""
        watch = self.leak_watch
        # (adopts_orphans: also for a configuration with no collection of its own,
        # pytester's getitem(), whose items a test runs.)
        if watch is not None and not watch.adopting and (self.adopts_orphans or self.uses_plugin()):
            watch.adopt_orphans()

    def warns_of_leaks(self, directory: str, pids: set[int]) -> bool:
        """Whether the processes ``pids`` a test left running are named: always under
        ``warn`` and ``kill``; under ``auto``, once the session uses the plugin, or when
        one of them entered a scope of the session (its table is in ``directory``)."""
        mode = self.settings.leaks
        if mode != "auto":
            return mode != "off"
        return self.uses_plugin() or leaks.joined_the_session(directory, pids)


def _nothing() -> None:
    pass


# Subscripted in the annotation only: a subscription at run time goes into typing's
# cache, which some Python versions keep to the process's very end, and through this
# class all of the plugin and pytest stayed reachable as the interpreter tore down.
SESSION: pytest.StashKey[SessionState] = pytest.StashKey()
RECORDS_FILE = "records.jsonl"  # the watchdog's records, beside its socket


def records_beside(address: str) -> str:
    """The watchdog's records file, for the watchdog listening at ``address``."""
    return os.path.join(os.path.dirname(address), RECORDS_FILE)


def is_worker(config: pytest.Config) -> bool:
    """Whether this process is an xdist worker."""
    return hasattr(config, "workerinput")


def worker_id(config: pytest.Config) -> str:
    """This process's xdist worker id (``gw0``); "" where it is no worker."""
    workerinput = getattr(config, "workerinput", None)
    return str(workerinput.get("workerid", "")) if isinstance(workerinput, dict) else ""


def any_item_asks_for(items: Iterable[object], fixtures: frozenset[str]) -> bool:
    """Whether any of ``items`` (collected tests) asks for one of ``fixtures``."""
    return any(not fixtures.isdisjoint(getattr(item, "fixturenames", ())) for item in items)


def uses_xdist(config: pytest.Config) -> bool:
    """Whether this process is an xdist controller (its tests run in workers)."""
    return config.pluginmanager.hasplugin("dsession")


def session_directory(config: pytest.Config) -> str:
    """The watchdog's session directory, also in an xdist worker ("" without one)."""
    state = config.stash.get(SESSION, None)
    if state is None:
        return ""
    if state.watchdog is not None:
        return state.watchdog.directory
    if state.watchdog_on_demand:
        return ""  # none yet; the process's connection may be an outer session's
    process = scopes.current_state()
    if process is not None and process.sock is not None and process.address:
        return os.path.dirname(process.address)
    return ""


def full_stacks(config: pytest.Config) -> bool:
    """Whether terminals show the stacks of expired scopes whole (``--full-trace`` or
    ``-vv``); otherwise the frames of pytest and its plugins leading to the test are
    left out, as pytest leaves them out of tracebacks."""
    return bool(config.getoption("fulltrace", False)) or config.get_verbosity() >= 2


def record_text(
    config: pytest.Config, record: records.ExpiryRecord, *, with_stack: bool = True
) -> str:
    """``record`` as the terminal shows it: files relative to rootdir, the stack
    trimmed unless :func:`full_stacks`."""
    from pytest_elastic_timer.core import records

    return records.format_record(
        record,
        with_stack=with_stack,
        rootdir=str(config.rootpath),
        full_stack=full_stacks(config),
    )


def stack_text(config: pytest.Config, stack: str) -> str:
    """A stack as the terminal shows it (see :func:`full_stacks`)."""
    from pytest_elastic_timer.core import stacks

    return stack if full_stacks(config) else stacks.trim_stack(stack)


def expiry_records(config: pytest.Config) -> list[records.ExpiryRecord]:
    """The watchdog's records so far (after a sync); also in an xdist worker, which
    finds them beside the watchdog's socket."""
    state = config.stash.get(SESSION, None)
    if state is None:
        return []
    if state.watchdog_on_demand:
        return []  # none started: the process's connection may be an outer session's
    process = scopes.process_state()
    if state.watchdog is not None:
        path = state.watchdog.records_path
    elif process.sock is not None and process.address:
        path = records_beside(process.address)
    else:
        return []
    if state.watchdog is not None and not process.answered() and not os.path.exists(path):
        # The watchdog has not answered the hello of the process that started it, the
        # session's first connection: it has not looked at any table yet and has no
        # record to settle. Nothing waits for it to start only to hear that.
        return []
    process.request("sync")
    if not os.path.exists(path):
        return []  # the watchdog makes the file with its first record
    from pytest_elastic_timer.core import records

    return records.read_records(path)
