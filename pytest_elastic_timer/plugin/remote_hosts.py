"""xdist workers on other hosts: a watchdog on each host, records back to the controller.

Worker side: a worker whose host identity (``core/hostid.py``) differs from the
controller's cannot reach the controller's watchdog, and that watchdog could not signal
it. It joins the watchdog of its own host instead (``launcher.join_host``, which starts
one if it is the first worker of the session there), hands it the descriptors of its
xdist gateway, and points the session's environment at it, so that everything it
starts is enforced there too. The records of that watchdog travel to the controller
as an attribute of the worker's test reports (xdist serializes a report's attributes)
and, at the end, in ``workeroutput``.

Controller side: the records arriving that way are handed to the controller's watchdog
(op ``forward``), which adds them to the session's records, so they land in the
terminal summary, the JSON report, JUnit and the CI outputs like the records of its
own host. A worker that its host's watchdog ended cannot forward anything: when xdist
reports it crashed, the controller fetches the records from that host through a fresh
gateway of the same spec (``fetch_from_host``); the replacement worker forwards them
too.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Generator
from typing import Any

import pytest

from pytest_elastic_timer.core import hostid, records, startup, unpatched, wire
from pytest_elastic_timer.plugin import launcher, lifecycle
from pytest_elastic_timer.plugin.state import SESSION, SessionState, worker_id
from pytest_elastic_timer.scope import client, scopes

HOST_KEY = "elastic_timer_host"  # workerinput: the controller's identity and settings
RECORDS_ATTRIBUTE = "elastic_timer_records"  # on reports and in workeroutput
LOST_KEY = "elastic_timer_watchdog_lost"  # workeroutput: why the host's watchdog is gone


# -- controller ----------------------------------------------------------------------
def workerinput(address: str, grace: float, scale: float) -> dict[str, Any]:
    """What a worker needs to tell whether it is on another host, and to start the
    watchdog there like the controller's."""
    return {
        "identity": hostid.current().to_json(),
        "token": os.path.basename(os.path.dirname(address)),
        "grace": grace,
        "scale": scale,
        "dump_signal": startup.session_dump_signal(),
    }


def forward(found: Any) -> None:
    """Hand records that came from another host to the controller's watchdog."""
    if not isinstance(found, list):
        return
    state = scopes.current_state()
    if state is None:
        return
    for record in found:
        if isinstance(record, dict) and record.get("host"):
            state.request("forward", record=_fitting(record))


def _fitting(record: dict[str, Any]) -> dict[str, Any]:
    """``record``, its stacks cut so that it fits in one message to the watchdog."""
    if len(json.dumps(record)) < wire.MAX_MESSAGE // 2:
        return record
    children = [{k: v for k, v in c.items() if k != "stack"} for c in record.get("children", [])]
    stack = str(record.get("stack", ""))
    return {**record, "stack": stack[: wire.MAX_MESSAGE // 8], "children": children}


class RemoteRecords:
    """Controller plugin: records of other hosts, from workers' output (those that
    come with a report are forwarded by ``xdist_support.WorkerReports``)."""

    NAME = "elastic_timer_remote_records"

    def __init__(self, state: SessionState) -> None:
        self.state = state

    def pytest_testnodeready(self, node: Any) -> None:
        # The session's workers, in its report: those of other hosts never register
        # with this host's watchdog themselves.
        worker = getattr(getattr(node, "gateway", None), "id", None)
        state = scopes.current_state()
        if isinstance(worker, str) and worker and state is not None:
            state.send("worker", worker=worker)

    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        output = getattr(node, "workeroutput", None)
        if isinstance(output, dict):
            forward(output.get(RECORDS_ATTRIBUTE))
            lost = output.get(LOST_KEY)
            if isinstance(lost, str) and lost:
                # The session's guarantees did not hold there: it fails, as for the
                # controller's own watchdog (lifecycle.check_watchdog).
                self.state.lose_watchdog(lost)
        spec = getattr(getattr(node, "gateway", None), "spec", None)
        if error and spec is not None and maybe_remote(spec):
            # A worker that execnet's socket server ran took the server with it (the
            # watchdog there ended it, say), and a loop starts the server again: the
            # fetch of the worker's records, and xdist's replacement worker, find it
            # only once it accepts again. xdist calls this first for every worker that
            # went down, whether or not a test was running.
            give_up = unpatched.monotonic() + self.state.ended_worker_patience()
            wait_for_socket_server(spec, give_up)


def _fetch_on_host(channel: object, token: str, worker: str, patience: float) -> None:
    """Runs on the other host, in a fresh gateway: the records of ``worker``. (execnet
    sends the source: only builtins may be named outside the body.)"""
    from pytest_elastic_timer.core import hostid, hostlink

    directory = hostid.host_directory(token, hostid.current())
    channel.send(hostlink.fetch(directory, worker, patience))  # type: ignore[attr-defined]


def fetch_from_host(spec: Any, token: str, worker: str, patience: float) -> list[dict[str, Any]]:
    """The records of ``worker`` from the watchdog of the host ``spec`` reaches, through
    a gateway of its own ([] where that is not possible)."""
    import execnet

    text = "//".join(p for p in str(spec).split("//") if p and not p.startswith("id="))
    group = execnet.Group()
    try:
        gateway = group.makegateway(text)
        channel = gateway.remote_exec(_fetch_on_host, token=token, worker=worker, patience=patience)
        found = channel.receive(timeout=patience + 30.0)
    except Exception:  # a host that cannot be reached again: the report stays xdist's
        return []
    finally:
        with contextlib.suppress(Exception):
            group.terminate(timeout=5.0)
    return [r for r in found if isinstance(r, dict)] if isinstance(found, list) else []


def wait_for_socket_server(spec: Any, give_up: float) -> None:
    """For a ``socket=`` spec, wait until a server there serves (until ``give_up`` at
    most). execnet's socket server runs a worker in its own process: the worker that
    was ended took the server with it, and the loop the guide runs it in starts it
    again. xdist may report the worker down a moment before that process is gone, while
    its port still accepts: only a server that answers is one to connect to."""
    address = getattr(spec, "socket", None)
    if not isinstance(address, str) or ":" not in address:
        return
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        return
    while True:
        try:
            if _serves(host or "localhost", int(port), give_up):
                return
        except (OSError, OverflowError):  # no such host, or port: nothing to wait for
            return
        if unpatched.monotonic() >= give_up:
            return
        unpatched.sleep(0.1)


# What the probe gives execnet's socket server to run: it reads one line, evaluates it
# as the source to execute, and runs nothing for None, then closes the connection.
_NOTHING_TO_RUN = b"None\n"


def _serves(host: str, port: int, give_up: float) -> bool:
    """Whether execnet's socket server at ``host:port`` reads and answers a line now:
    the end of the connection after :data:`_NOTHING_TO_RUN`. A server still busy with
    the worker it ran never reads it (until ``give_up`` at most), and one that is
    ending resets the connection. Raises OSError for an address that cannot be."""
    with unpatched.Socket() as probe:
        probe.settimeout(max(0.1, min(1.0, give_up - unpatched.monotonic())))
        if probe.connect_ex((host, port)) != 0:
            return False
        try:
            probe.sendall(_NOTHING_TO_RUN)
            return probe.recv(1) == b""
        except OSError:  # reset, or no answer in time
            return False


def maybe_remote(spec: Any) -> bool:
    """Whether a gateway of ``spec`` may run on another host: anything but a plain
    ``popen`` (a ``popen//python=`` may run a wrapper that enters another host)."""
    return not (getattr(spec, "popen", None) and not getattr(spec, "python", None))


# -- worker --------------------------------------------------------------------------
class RemoteWorker:
    """Worker plugin on another host: forwards its host's records to the controller."""

    NAME = "elastic_timer_remote_worker"

    def __init__(self, config: pytest.Config, host: launcher.HostWatchdog) -> None:
        self.config = config
        self.host = host
        self.size = -1
        self.sent: dict[records.RecordKey, str] = {}

    def new_records(self, *, sync: bool) -> list[dict[str, Any]]:
        """Records of this host not forwarded by this worker yet: those of workers
        that were ended here too (the controller keeps one of each)."""
        if sync:
            state = scopes.current_state()
            if state is not None:
                state.request("sync")
        try:
            size = os.stat(self.host.records_path).st_size
        except OSError:
            return []
        if size == self.size:
            return []
        self.size = size
        out = []
        for record in records.read_records(self.host.records_path):
            seen = f"{record.action} {record.ended}"
            if self.sent.get(record.key) != seen:
                self.sent[record.key] = seen
                out.append(record.to_json())
        return out

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        report = yield
        found = self.new_records(sync=report.failed)
        if found:
            setattr(report, RECORDS_ATTRIBUTE, found)
        return report

    # Inside xdist's own wrapper, which sends workeroutput once this one is done.
    @pytest.hookimpl(wrapper=True, trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> Generator[None, None, None]:
        try:
            return (yield)
        finally:
            found = self.new_records(sync=True)
            output = getattr(self.config, "workeroutput", None)
            if found and isinstance(output, dict):
                output[RECORDS_ATTRIBUTE] = found
            lost = self._lost_watchdog()
            if lost and isinstance(output, dict):
                output[LOST_KEY] = f"{lost} (worker {worker_id(self.config)})"

    def _lost_watchdog(self) -> str:
        """Why this host's watchdog is gone ("" while it serves): noticed before a test,
        or now, if it died in the last one (as the controller looks at its own)."""
        state = self.config.stash[SESSION]
        process = scopes.current_state()
        if not state.lost_watchdog and process is not None and not process.watchdog_alive():
            state.watchdog_died(process.watchdog_pid)
        return state.lost_watchdog

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        self.host.link.leave()
        self.host.link.close()


def gateway_fds(config: pytest.Config) -> list[int]:
    """The read side of this worker's connection to the controller (execnet's pipe or
    socket), for the host's watchdog to watch; [] where it cannot be found."""
    for plugin in config.pluginmanager.get_plugins():
        gateway = getattr(getattr(plugin, "channel", None), "gateway", None)
        io = getattr(gateway, "_io", None)  # execnet keeps its transport here
        for name in ("infile", "sock"):
            stream = getattr(io, name, None)
            try:
                fd = stream.fileno() if stream is not None else -1
            except (OSError, ValueError, AttributeError):
                continue
            if fd >= 0:
                return [fd]
    return []


def join(config: pytest.Config, controller: Any) -> bool:
    """On a host other than the controller's, join (or start) this host's watchdog and
    make it the session's watchdog of this process and its children. Returns whether
    this worker is on another host."""
    if not isinstance(controller, dict):
        return False
    home = hostid.HostIdentity.from_json(controller.get("identity"))
    here = hostid.current()
    if home is None or home.same_host(here):
        return False
    config.stash[SESSION].other_host = here.hostname
    worker = worker_id(config)
    grace = float(controller.get("grace", 2.0))
    scale = float(controller.get("scale", 1.0))
    dump_signal = int(controller.get("dump_signal", 0))
    try:
        host = launcher.join_host(
            str(controller.get("token", "")),
            grace=grace,
            scale=scale,
            dump_signal=dump_signal,
            worker=worker,
            gateway_fds=gateway_fds(config),
        )
    except (launcher.WatchdogError, OSError, ValueError) as exc:
        lifecycle.warn_without_watchdog(
            config,
            f"no watchdog on this host ({exc}); scopes of worker {worker} are enforced "
            "in-process only",
        )
        os.environ.pop(client.ENV_ADDRESS, None)  # the controller's: unreachable here
        return True
    python_path = startup.python_path(os.environ.get("PYTHONPATH"))
    for name, value in (
        (client.ENV_ADDRESS, host.address),
        (client.ENV_SCALE, repr(scale)),
        (startup.ENV_DUMP_SIGNAL, str(dump_signal)),
        (startup.ENV_TORCH_TIMER_FILE, os.path.join(host.directory, startup.TORCH_TIMER_FIFO)),
        ("PYTHONPATH", python_path),
    ):
        os.environ[name] = value
    scopes.reattach()
    config.pluginmanager.register(RemoteWorker(config, host), RemoteWorker.NAME)
    return True
