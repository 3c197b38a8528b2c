"""The functions of ``time``, ``os``, ``select``, ``socket``, ``subprocess``, ``json``,
``threading`` and the builtin ``open`` this package calls in test processes, bound when
the package is first imported.

A test may replace ``time.sleep``, ``time.time``, ``os.kill``, ``os.getpid``,
``subprocess.Popen``, ``json.dumps``, ``threading.Thread`` or ``open`` with a mock (to
test retry delays or a file error, say, or to forbid threads), freeze the clocks
(freezegun), or block sockets (pytest-socket), and the plugin still works inside that
test and inside a pytest session the test runs: entering scopes, stopping a watchdog,
ending a leftover process, delivering an interrupt, reporting an expiry. Modules
imported late (the process-tree code, which loads psutil only where a leak is looked
at) take these references from here, bound before any test ran.
"""

from __future__ import annotations

import _socket
import builtins
import functools
import json
import os
import select as _select_module
import socket
import subprocess
import threading
import time

sleep = time.sleep
# Deadlines are on the real clock, frozen or not. While a test freezes time, freezegun
# replaces every module attribute that *is* ``time.time`` or ``time.monotonic`` with its
# fake, in every module loaded; these are the same functions under another identity.
now = functools.partial(time.time)
monotonic = functools.partial(time.monotonic)
kill = os.kill
# The target of the signals a process sends itself: a test may fake its pid.
getpid = os.getpid
select = _select_module.select
Popen = subprocess.Popen
PIPE = subprocess.PIPE
# Starting and reaping the watchdog (plugin/launcher.py): no Popen object is left to
# warn that its process still runs when pytest exits without waiting for it.
posix_spawn = getattr(os, "posix_spawn", None)
waitpid = os.waitpid
waitid = getattr(os, "waitid", None)
pidfd_open = getattr(os, "pidfd_open", None)
# The leak check's reads of /proc/self/task/*/children, before and after every test: a
# fixture may fake a directory listing or a file read for the test it sets up.
listdir = os.listdir
open_fd = os.open
pread = os.pread
close = os.close
write = os.write

# The random part of the names of a session's files (tables, dumps, traces, rings):
# not uuid.uuid4, which tests replace to get fixed ids (and whose module, with the
# platform module it loads, costs a process that has neither some 2 ms).
urandom = os.urandom


def random_hex(nbytes: int = 4) -> str:
    """``2 * nbytes`` random hexadecimal digits."""
    return urandom(nbytes).hex()


# Messages to the watchdog, records read back, report files written.
open = builtins.open
dumps = json.dumps
loads = json.loads
# The package's own threads (standby, sentinel, interrupter, a retried interrupt), and
# the thread ids its scopes are kept by.
Thread = threading.Thread
Timer = threading.Timer
get_ident = threading.get_ident

# pytest-socket's --disable-socket replaces the class ``socket.socket`` for the length of
# each test, and its --allow-hosts replaces ``socket.socket.connect``: the plugin's own
# Unix sockets (to its watchdog) are made and connected with these.
Socket = socket.socket
connect = socket.socket.connect  # the method itself, not whatever the class holds later


def socketpair() -> tuple[socket.socket, socket.socket]:
    """A connected pair of Unix stream sockets made with :data:`Socket` (the standard
    ``socket.socketpair`` wraps its pair in whatever ``socket.socket`` is by then)."""
    first, second = _socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return Socket(fileno=first.detach()), Socket(fileno=second.detach())
