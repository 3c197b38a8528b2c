"""Stand-in hosts for multi-host tests: Linux namespaces instead of other machines.

A stand-in host is a pid, mount and UTS namespace made by ``unshare --pid --fork
--mount --uts --mount-proc``: its own host name, its own pid numbers (and /proc), and a
private tmpfs on /dev/shm, while the rest of the file system is shared, as NFS homes
are. Its first process (pid 1 there) reaps orphans until the test lets it go; when it
ends, the kernel ends everything left in the namespace.

``host.wrapper`` is a script that runs Python *on* that host (``nsenter`` into the
namespaces, in the current directory), so ``--tx popen//python=<wrapper>`` puts an
xdist worker there, and several such gateways share the host, as several workers
reached over ssh share a machine.

From the root namespace every process of a stand-in host is visible under its outer
pid, so the leftover check of ``conftest.py`` sees them too; the host's /dev/shm is
visible as ``/proc/<pid 1>/root/dev/shm``.
"""

from __future__ import annotations

import functools
import glob
import os
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

UNSHARE = ("unshare", "--pid", "--fork", "--mount", "--uts", "--mount-proc")

# pid 1 of the stand-in host: name it, give it a private /dev/shm, then reap orphans
# (a namespace's init must, or they stay zombies) until stdin is closed.
HOLDER = r"""
import os, select, socket, subprocess, sys
socket.sethostname(sys.argv[1])
subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=1777", "tmpfs", "/dev/shm"], check=True)
sys.stdout.write("ready\n")
sys.stdout.flush()
while True:
    ready = select.select([0], [], [], 0.2)[0]
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass
    if ready and not os.read(0, 1024):
        break
"""

WRAPPER = """#!/bin/sh
exec nsenter --target {pid} --pid --mount --uts --wd="$PWD" -- {python} "$@"
"""


@functools.lru_cache(maxsize=1)
def unavailable() -> str:
    """Why stand-in hosts cannot be made here ("" when they can)."""
    for tool in ("unshare", "nsenter", "mount"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    try:
        done = subprocess.run(
            [*UNSHARE, "true"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare failed: {exc}"
    if done.returncode != 0:
        return f"unshare is not permitted here: {done.stderr.strip()}"
    return ""


def namespace_of(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return ""


class StandInHost:
    """One stand-in host: its pid 1 (seen from outside) and a Python wrapper for it."""

    def __init__(self, name: str, directory: Path) -> None:
        self.name = name
        self.holder = subprocess.Popen(
            [*UNSHARE, sys.executable, "-c", HOLDER, name],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert self.holder.stdout is not None
        if self.holder.stdout.readline() != b"ready\n":
            self.close()
            raise RuntimeError(f"stand-in host {name} did not start")
        # unshare forks: pid 1 of the namespace is unshare's child.
        children = psutil.Process(self.holder.pid).children()
        assert len(children) == 1, children
        self.init = children[0]
        self.namespace = namespace_of(self.init.pid)
        # Two stand-in hosts may share a name (cloned VMs, same-named containers).
        self.wrapper = directory / f"python-on-{name}"
        if self.wrapper.exists():
            self.wrapper = directory / f"python-on-{name}-{self.init.pid}"
        self.wrapper.write_text(WRAPPER.format(pid=self.init.pid, python=sys.executable))
        self.wrapper.chmod(0o755)

    @property
    def spec(self) -> str:
        """An xdist ``--tx`` spec for one worker on this host."""
        return f"popen//python={self.wrapper}"

    def processes(self) -> list[psutil.Process]:
        """Every running process of this host but its pid 1 (outer pids)."""
        found = []
        for proc in psutil.process_iter():
            if proc.pid == self.init.pid or namespace_of(proc.pid) != self.namespace:
                continue
            try:
                if proc.status() != psutil.STATUS_ZOMBIE:
                    found.append(proc)
            except psutil.Error:
                continue
        return found

    def shm(self) -> str:
        """This host's /dev/shm, seen from outside."""
        return f"/proc/{self.init.pid}/root/dev/shm"

    def session_dirs(self) -> list[str]:
        return glob.glob(os.path.join(self.shm(), "pytest-elastic-timer-*"))

    def close(self) -> None:
        """End the host: its pid 1 exits, and the kernel ends all that is left there."""
        if self.holder.stdin is not None:
            self.holder.stdin.close()
        try:
            self.holder.wait(10)
        except subprocess.TimeoutExpired:
            self.holder.kill()
            self.holder.wait()
        if self.holder.stdout is not None:
            self.holder.stdout.close()


SSH = """#!/bin/sh
# A stand-in for ssh, as execnet calls it: ssh -C [options] HOST COMMAND runs COMMAND
# with sh on the stand-in host HOST, in a fresh environment (ssh passes none on).
while [ $# -gt 2 ]; do shift; done
case "$1" in
{cases}
  *) echo "ssh: no stand-in host $1" >&2; exit 255;;
esac
exec env -i PATH=/usr/bin:/bin HOME="$HOME" \\
    nsenter --target "$pid" --pid --mount --uts --wd=/ -- /bin/sh -c "$2"
"""


def fake_ssh(hosts: list[StandInHost], directory: Path) -> Path:
    """A directory with an ``ssh`` that reaches ``hosts`` by name (put it first on
    PATH): ``--tx ssh=host-a//python=...`` then runs a worker there over pipes, with
    nothing of the controller's environment, as a real ssh would."""
    bin_dir = directory / "ssh-bin"
    bin_dir.mkdir(exist_ok=True)
    cases = "\n".join(f"  {h.name}) pid={h.init.pid};;" for h in hosts)
    ssh = bin_dir / "ssh"
    ssh.write_text(SSH.format(cases=cases))
    ssh.chmod(0o755)
    return bin_dir


def require() -> None:
    """Skip the calling test, with the reason, where stand-in hosts cannot be made."""
    why = unavailable()
    if why:
        pytest.skip(f"stand-in hosts need Linux namespaces: {why}")
