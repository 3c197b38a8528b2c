"""Installed, the plugin changes nothing a suite that does not use it can observe.

It loads into every pytest session of its environment, other projects' inner (pytester)
sessions included: no warning under strict settings, a nested session leaves its
process as it found it, nothing goes through names a test may patch, and the session's
sitecustomize chains to the one it shadows without undoing it.
"""

from __future__ import annotations

import compileall
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from helpers import LEAN, top_level_environment, wait_gone

import pytest_elastic_timer
from pytest_elastic_timer.core.plain_imports import plainly

STRICT_SUITE = '''
import subprocess
import os
import sys

import pytest_elastic_timer as et

CHILD = """
import pytest_elastic_timer as et

with et.expires(30, scope="child"):
    pass
print("child done")
"""


def test_scope():
    with et.expires(30, scope="outer"):
        with et.expires(20, scope="inner"):
            pass


def test_child_process_is_quiet():
    done = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, encoding="utf-8"
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "child done\\n", "")


def test_marker_budget(elastic_timer):
    assert elastic_timer.budget is None
'''


@pytest.mark.skipif(sys.version_info < (3, 10), reason="EncodingWarning is new in 3.10")
@pytest.mark.parametrize("workers", [[], ["-p", "xdist", "-n", "2"]], ids=["one", "xdist"])
def test_strict_warnings_see_nothing(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, workers: list[str]
) -> None:
    """Under PYTHONWARNDEFAULTENCODING=1 and every warning an error (in pytest and in
    every Python it starts), a session with scopes, a child process and xdist passes
    and prints nothing on stderr."""
    monkeypatch.setenv("PYTHONWARNDEFAULTENCODING", "1")
    monkeypatch.setenv("PYTHONWARNINGS", "error")
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    pytester.makeini("[pytest]\nfilterwarnings = error\n")
    pytester.makepyfile(test_strict=STRICT_SUITE)
    result = pytester.runpytest_subprocess(
        "-p", "elastic_timer", "-p", "no:cacheprovider", *workers, "-W", "error"
    )
    result.assert_outcomes(passed=3)
    assert result.errlines == []


BY_PACKAGE_NAME_SUITE = """
import time

import pytest


@pytest.mark.expires(0.3)
def test_hangs():
    time.sleep(30)
"""


@pytest.mark.parametrize(
    ("args", "conftest", "enforced"),
    [
        (["-p", "pytest_elastic_timer"], "", True),
        ([], 'pytest_plugins = ["pytest_elastic_timer"]\n', True),
        (["-p", "elastic_timer"], 'pytest_plugins = ["pytest_elastic_timer"]\n', True),
        (["-p", "pytest_elastic_timer", "-p", "no:elastic_timer"], "", False),
        (["-p", "no:elastic_timer", "-p", "pytest_elastic_timer"], "", False),
    ],
    ids=["option", "conftest", "both", "then-blocked", "blocked-first"],
)
def test_the_plugin_loaded_by_the_packages_name_is_the_plugin(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    args: list[str],
    conftest: str,
    enforced: bool,
) -> None:
    """``-p pytest_elastic_timer`` or ``pytest_plugins = ["pytest_elastic_timer"]`` (the
    package's name, as other plugins are loaded) loads the plugin ``elastic_timer``: the
    package alone has no hooks, and the budget went unenforced, silently. With both
    names, pytest does not warn that it cannot rewrite the package's asserts; blocked
    (``-p no:elastic_timer``), the plugin stays out."""
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    if conftest:
        pytester.makeconftest(conftest)
    pytester.makepyfile(test_named=BY_PACKAGE_NAME_SUITE)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-W", "error", *args)
    if enforced:
        result.assert_outcomes(failed=1)
        assert "scope 'test_hangs::call' expired" in result.stdout.str()
        assert "Warning" not in result.stdout.str() + result.stderr.str()
    else:  # the marker is unknown without the plugin: an error under -W error
        result.assert_outcomes(errors=1)
        assert "Unknown pytest.mark.expires" in result.stdout.str()


# Loaded through pytest's hook: the package, the plugin's package and the plugin module
# pytest imports by its entry point, and what that module imports first.
ENTRY_MODULES = {
    "pytest_elastic_timer",
    "pytest_elastic_timer.plugin",
    "pytest_elastic_timer.plugin.hooks",
    "pytest_elastic_timer.core",
    "pytest_elastic_timer.core.plain_imports",
}

LOADERS_SUITE = """
import os
import subprocess
import sys
import time

import pytest

import pytest_elastic_timer as et

ENTRY = __ENTRY__


@pytest.mark.expires(0.3)
def test_hangs():
    time.sleep(30)


def test_lazy_name():
    assert et.Event.__module__ == "pytest_elastic_timer.sync.client"


def test_leaves_a_process_the_plugin_ends():
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_zz_loaders():
    assert "site" in et.__file__.split(os.sep)  # the copy installed as from a wheel
    ours = {n: m for n, m in sys.modules.items() if n.split(".")[0] == "pytest_elastic_timer"}
    rewritten = sorted(
        n for n, m in ours.items() if type(m.__spec__.loader).__name__ == "AssertionRewritingHook"
    )
    assert set(rewritten) <= ENTRY
    assert "pytest_elastic_timer.plugin.expiry" in ours  # loaded at the first failure
    assert "pytest_elastic_timer.sync.client" in ours
    assert "pytest_elastic_timer.watchdog.proctree" in ours  # the leftover process ended
    assert not [f for f in sys.meta_path if type(f).__module__.startswith("pytest_elastic_timer")]
"""


def _installed_as_from_a_wheel(site: Path) -> Path:
    """A copy of the package in ``site`` as pip installs it from a wheel: bytecode
    compiled, beside a dist-info whose RECORD lists its files (what pytest marks for
    assertion rewriting) and whose entry points name the plugin. A development install
    lists only its import finder, so pytest rewrites none of it."""
    source = Path(pytest_elastic_timer.__file__).parent
    package = site / "pytest_elastic_timer"
    shutil.copytree(source, package, ignore=shutil.ignore_patterns("__pycache__"))
    compileall.compile_dir(package, quiet=1)
    info = site / "pytest_elastic_timer-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: pytest-elastic-timer\nVersion: 0.1.0\n", encoding="utf-8"
    )
    (info / "entry_points.txt").write_text(
        "[pytest11]\nelastic_timer = pytest_elastic_timer.plugin.hooks\n", encoding="utf-8"
    )
    files = sorted(p.relative_to(site).as_posix() for p in package.rglob("*") if p.is_file())
    (info / "RECORD").write_text("".join(f"{name},,\n" for name in files), encoding="utf-8")
    return site


def _run_installed_without_cached_bytecode(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, workers: list[str], *args: str
) -> pytest.RunResult:
    """pytest in a subprocess, the package installed as from a wheel, plugins loaded
    from their entry points (pytest's default), PYTHONDONTWRITEBYTECODE=1; the lean
    set of plugins, with xdist where ``workers`` asks for it."""
    site = _installed_as_from_a_wheel(pytester.path / "site")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.delenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    pairs = zip(LEAN[::2], LEAN[1::2], strict=True)
    lean = [arg for pair in pairs if not (workers and pair[1] == "no:xdist") for arg in pair]
    return pytester.runpytest_subprocess(*lean, *args, *workers)


@pytest.mark.parametrize("workers", [[], ["-p", "xdist", "-n", "1"]], ids=["one", "xdist"])
def test_where_pytest_cannot_cache_bytecode_it_does_not_compile_the_plugin_at_each_start(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, workers: list[str]
) -> None:
    """pytest marks every module of a plugin's distribution for assertion rewriting when
    it loads plugins from entry points (its default). Under PYTHONDONTWRITEBYTECODE=1
    (or where the installation is read-only) it would then compile the plugin's modules
    from source at every start of pytest and of each xdist worker. Only the entry
    module's few go through its hook: the modules it loads at start, at the first
    failure, to end a leftover process and for a lazy public name come from their
    bytecode, pytest does not warn about them, and no finder of the plugin stays on
    ``sys.meta_path``."""
    pytester.makepyfile(
        test_loaders=LOADERS_SUITE.replace("__ENTRY__", f"set({sorted(ENTRY_MODULES)!r})")
    )
    result = _run_installed_without_cached_bytecode(
        pytester, monkeypatch, workers, "--elastic-timer-leaks=kill"
    )
    result.assert_outcomes(passed=3, failed=1, warnings=1)  # the warning: the leftover
    assert "scope 'test_hangs::call' expired" in result.stdout.str()
    assert "PytestAssertRewriteWarning" not in result.stdout.str() + result.stderr.str()


class _Finder:
    """A meta path finder that finds nothing."""

    def find_spec(self, *args: object) -> None:
        return None


def test_plainly_puts_back_the_very_list_it_found() -> None:
    """``plainly()`` gives its block a new ``sys.meta_path`` list and then puts back
    the list object it found (not a copy), with what the block added or removed; a
    list the block put in place of its own is left as it is, without the finder."""
    original = sys.meta_path
    with plainly():
        assert sys.meta_path is not original
        assert type(sys.meta_path[0]).__name__ == "_OwnModulesFinder"
    assert sys.meta_path is original

    added = _Finder()
    try:
        with plainly():
            sys.meta_path.append(added)
        assert sys.meta_path is original
        assert sys.meta_path[-1] is added
    finally:
        original.remove(added)

    replaced = [*original]
    try:
        with plainly():
            sys.meta_path = [*sys.meta_path, added]
        assert sys.meta_path is not original
        assert [f for f in sys.meta_path if f is not added] == replaced
    finally:
        sys.meta_path = original


LOADERS_AT_THE_END_CONFTEST = """
import sys


def pytest_unconfigure(config):
    # At the very end: what the session's last hooks imported counts too.
    rewritten = sorted(
        name
        for name, module in list(sys.modules.items())
        if name.split(".")[0] == "pytest_elastic_timer"
        and type(module.__spec__.loader).__name__ == "AssertionRewritingHook"
    )
    # Not from PYTEST_XDIST_WORKER: the outer session's worker may have set it.
    who = getattr(config, "workerinput", {}).get("workerid", "controller")
    with open(f"rewritten-{who}.txt", "w") as f:
        f.write("\\n".join(rewritten))
"""


@pytest.mark.parametrize("workers", [[], ["-p", "xdist", "-n", "1"]], ids=["one", "xdist"])
def test_where_pytest_cannot_cache_bytecode_the_ci_outputs_and_the_sessions_end_are_not_compiled(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, workers: list[str]
) -> None:
    """As above, with pytest's JUnit XML asked for (the plugin reads its path at start)
    and up to the session's end (the facts its last hooks are given): no module of the
    plugin but the entry module's few goes through pytest's hook, in the controller
    nor in a worker."""
    pytester.makeconftest(LOADERS_AT_THE_END_CONFTEST)
    pytester.makepyfile(test_one="def test_one():\n    pass\n")
    result = _run_installed_without_cached_bytecode(
        pytester, monkeypatch, workers, "--junitxml=junit.xml"
    )
    result.assert_outcomes(passed=1)
    files = sorted(pytester.path.glob("rewritten-*.txt"))
    assert len(files) == 1 + bool(workers), files
    for path in files:
        rewritten = set(path.read_text(encoding="utf-8").split())
        assert rewritten <= ENTRY_MODULES, (path.name, sorted(rewritten - ENTRY_MODULES))


TORCH_DISTRIBUTED_TEST = """
import sys

import torch.distributed


def test_imports_torch_distributed():
    # Installed by then: the session's hook wraps torch.distributed's functions.
    assert "pytest_elastic_timer.scope.collectives" in sys.modules
"""


def test_where_pytest_cannot_cache_bytecode_the_collectives_recorder_is_not_compiled(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The collectives recorder, loaded when a test imports torch.distributed, comes
    from its bytecode too: a process of the session that imports torch would otherwise
    compile it (and what it imports) from source at every start."""
    pytest.importorskip("torch.distributed", reason="the recorder is loaded with torch")
    pytester.makeconftest(LOADERS_AT_THE_END_CONFTEST)
    pytester.makepyfile(test_torch=TORCH_DISTRIBUTED_TEST)
    result = _run_installed_without_cached_bytecode(pytester, monkeypatch, [])
    result.assert_outcomes(passed=1)
    rewritten = set((pytester.path / "rewritten-controller.txt").read_text("utf-8").split())
    assert rewritten <= ENTRY_MODULES, sorted(rewritten - ENTRY_MODULES)


THREAD_PER_TEST_SUITE = """
import os
import threading

import pytest


@pytest.fixture(autouse=True)
def server_thread():
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    yield
    stop.set()
    thread.join()


@pytest.mark.parametrize("i", range(150))
def test_many(i):
    pass


def test_zz_open_files():
    assert len(os.listdir("/proc/self/fd")) < 40
"""


@pytest.mark.parametrize("workers", [[], ["-p", "xdist", "-n", "2"]], ids=["one", "xdist"])
def test_a_thread_per_test_leaves_no_file_open(
    pytester: pytest.Pytester, workers: list[str]
) -> None:
    """A fixture that starts a thread for every test (a server, say): the leak check
    reads the children of every thread, and keeps no file open for a thread that has
    ended. 150 such tests left 150 files open, and a long suite ran out of them."""
    pytester.makepyfile(test_threads=THREAD_PER_TEST_SUITE)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:asyncio", *workers)
    result.assert_outcomes(passed=151)


WAITING_SUITE = """
import os


def test_no_child_to_reap():
    try:
        found = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
        found = None
    assert found is None


def test_wait_reaps_the_tests_own_child():
    pid = os.fork()
    if pid == 0:
        os._exit(7)
    assert os.wait() == (pid, 7 << 8)
"""


@pytest.mark.parametrize("quiet", ["-q", "--no-header"])
def test_a_test_that_waits_for_any_child_finds_none_of_the_plugins(
    pytester: pytest.Pytester, quiet: str
) -> None:
    """``os.wait()`` in a test finds the test's own children only. The shell that starts
    the watchdog was reaped when pytest first asked for the watchdog's pid, for the
    header: under -q or --no-header, tests found it."""
    pytester.makepyfile(test_waiting=WAITING_SUITE)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:asyncio", quiet)
    result.assert_outcomes(passed=2)


TEMP_DIR_SUITE = """
import tempfile


def test_a_temp_dir_of_its_own(monkeypatch, tmp_path):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    assert tempfile.tempdir is None
    assert tempfile.gettempdir() == str(tmp_path)
"""


def test_a_test_that_sets_tmpdir_gets_it(pytester: pytest.Pytester) -> None:
    """The plugin finds the temporary directory without caching it in
    ``tempfile.tempdir`` (under -s, pytest caches none itself): a test that sets
    ``TMPDIR`` gets its own directory from ``tempfile``."""
    pytester.makepyfile(test_temp=TEMP_DIR_SUITE)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:asyncio", "-s")
    result.assert_outcomes(passed=1)


NO_WATCHDOG_PLUGIN = """
from pytest_elastic_timer.plugin import launcher


def cannot_start(**kwargs):
    raise OSError("no watchdog here")


launcher.start = cannot_start
"""

EXPIRING_SUITE = """
import time

import pytest


@pytest.mark.expires(0.3)
def test_expires():
    time.sleep(30)
"""


HELD_SUITE = """
import os
import time


def test_the_watchdog_holds_none_of_it(elastic_timer_server):
    held = f"/proc/{elastic_timer_server.pid}/fd/300"
    give_up = time.monotonic() + 10  # (closed as the watchdog starts)
    while os.path.exists(held) and time.monotonic() < give_up:
        time.sleep(0.01)
    assert not os.path.exists(held)
"""


def test_a_watchdog_that_cannot_start_under_warnings_as_errors_leaves_the_session_running(
    pytester: pytest.Pytester,
) -> None:
    """Under -W error, a watchdog that cannot start is said on stderr, and the session
    runs with its scopes enforced in-process: the warning, raised at configure, ended
    pytest with an INTERNALERROR before any test ran."""
    pytester.makepyfile(no_watchdog=NO_WATCHDOG_PLUGIN, test_expiring=EXPIRING_SUITE)
    result = pytester.runpytest_subprocess(
        "-p", "no_watchdog", "-p", "no:cacheprovider", "-p", "no:asyncio", "-W", "error"
    )
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*scope 'test_expires::call' expired after 0.3*"])
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()
    result.stderr.fnmatch_lines(
        ["*pytest-elastic-timer: no watchdog here; scopes are enforced in-process only*"]
    )


def test_a_descriptor_above_the_limit_on_open_files_does_not_keep_the_watchdog_from_starting(
    pytester: pytest.Pytester,
) -> None:
    """pytest started with a descriptor open above its (lowered) limit on open files,
    which posix_spawn cannot close in the watchdog: the watchdog starts all the same,
    closes that descriptor itself, and ends the test at its deadline. It did not
    start."""
    pytester.makepyfile(test_expiring=EXPIRING_SUITE, test_held=HELD_SUITE)
    report = pytester.path / "report.json"
    command = (
        f"exec 300</dev/null; ulimit -n 256; exec {sys.executable} -m pytest -p no:cacheprovider"
        f" -p no:asyncio --elastic-timer-report={report}"
    )
    run = subprocess.run(
        ["bash", "-c", command], cwd=pytester.path, capture_output=True, text=True, timeout=60
    )
    assert "enforced in-process only" not in run.stdout + run.stderr, run.stdout + run.stderr
    assert "elastic-timer: watchdog pid" in run.stdout, run.stdout
    (record,) = json.loads(report.read_text(encoding="utf-8"))["expired"]
    assert (record["scope"], record["action"]) == ("test_expires::call", "interrupted")
    assert "1 failed, 1 passed" in run.stdout, run.stdout


SCRIPT = """
import os
import sys
import time

import pytest

import psutil

started_with = sys.meta_path  # the interpreter keeps this very list to its end
before = sorted(os.listdir("/proc/self/fd")), list(sys.meta_path), psutil.Process().children()
for _ in range(3):
    args = ["-q", "-p", "no:cacheprovider", "-p", "no:asyncio", *sys.argv[1:], "test_one.py"]
    assert pytest.main(args) == 0
time.sleep(1.0)  # the watchdogs stopped: they end within moments
after = sorted(os.listdir("/proc/self/fd")), list(sys.meta_path), psutil.Process().children()
print("SAME" if after == before else f"CHANGED {before} {after}")
# pytest's rewriting hook holds its whole session: none may stay in that list.
print("LIST", sys.meta_path is started_with, [type(f).__name__ for f in started_with])
"""


def _outside_this_suites_session(monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment of a process started from a shell: nothing of the session that
    runs this suite (its watchdog's address and settings, its torch file timer)."""
    for name in [n for n in os.environ if n.startswith("PYTEST_ELASTIC_TIMER")]:
        monkeypatch.delenv(name)
    monkeypatch.delenv("TORCHELASTIC_TIMER_FILE", raising=False)


@pytest.mark.parametrize("leaks", [[], ["--elastic-timer-leaks=warn"]], ids=["auto", "warn"])
def test_pytest_main_in_a_script_leaves_the_process_as_it_found_it(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, leaks: list[str]
) -> None:
    """A script that runs pytest.main() and goes on: each session's watchdog is let go
    (no descriptor of it stays open, and no zombie: a session that adopts orphans does
    so once the watchdog's shell is reaped), and the import hook that waits for
    torch.distributed goes with its session. All three stayed, for the rest of the
    script. ``sys.meta_path`` is the list it was, not a copy: the first session's
    rewriting hook, and all it holds, stayed in the list the interpreter started with
    (which it keeps to its end) while pytest removed it from the copy."""
    _outside_this_suites_session(monkeypatch)  # a script run from a shell
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    shadowing = os.path.join("pytest_elastic_timer", "core", "pythonpath")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if shadowing not in p))
    pytester.makepyfile(test_one="def test_one():\n    pass\n")
    script = pytester.makepyfile(script=SCRIPT)
    result = pytester.run(sys.executable, script, *leaks, timeout=60)
    assert result.ret == 0, result.stderr.str()
    result.stdout.fnmatch_lines(["SAME", "LIST True *"])
    assert "AssertionRewritingHook" not in result.stdout.str()


def _still_reachable_at_the_end(pytester: pytest.Pytester, *args: str) -> set[str]:
    """The modules of pytest and of this package that the interpreter still found
    reachable as a pytest process with ``args`` ended, and wiped one by one
    (``python -v`` says which), rather than collected."""
    argv = [sys.executable, "-v", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "xdist"]
    with top_level_environment():
        result = pytester.run(*argv, *args, "test_one.py", timeout=60)
    assert result.ret == 0, result.stdout.str()
    wiped = re.findall(r"^# cleanup\[3\] wiping (\S+)$", result.stderr.str(), re.MULTILINE)
    assert wiped  # python -v spoke: the interpreter's own modules are always wiped
    return {m for m in wiped if m.split(".")[0] in ("_pytest", "pytest", "pytest_elastic_timer")}


@pytest.mark.parametrize("used", [[], ["--expires=30"]], ids=["loaded", "used"])
def test_at_the_end_of_the_process_nothing_of_the_session_stays_reachable(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, used: list[str]
) -> None:
    """When a pytest process with the plugin ends, the interpreter collects pytest's
    modules, and this package's, as it does pytest's without the plugin: the plugin
    keeps none of them reachable to the end, where they are wiped one by one instead
    (``python -v`` says which). A rewriting hook left in the ``sys.meta_path`` list the
    interpreter started with kept the whole session reachable, and so did a
    ``StashKey[SessionState]`` subscribed at run time, through typing's cache, where the
    interpreter keeps that cache to its end (Python 3.10, 3.12 and 3.13 here); the
    process took milliseconds longer to end."""
    _outside_this_suites_session(monkeypatch)
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    pytester.makepyfile(test_one="def test_one():\n    assert True\n")
    without = _still_reachable_at_the_end(pytester)
    with_plugin = _still_reachable_at_the_end(pytester, "-p", "elastic_timer", *used)
    assert with_plugin <= without, f"kept by the plugin: {sorted(with_plugin - without)}"


SHADOWED_SUITE = """
import time

import pytest


def test_passes():
    pass


@pytest.mark.expires(0.5)
def test_hangs():
    time.sleep(30)
"""


def test_a_project_module_named_like_the_standard_librarys_is_not_the_watchdogs(
    pytester: pytest.Pytester,
) -> None:
    """A module at the project's root named like one of the standard library's (token.py,
    json.py), with pytest run as its console script: the watchdog, started from that
    directory, imports the standard library's own and serves the session. It died at
    start-up, and the session read "watchdog lost"."""
    script = os.path.join(os.path.dirname(sys.executable), "pytest")
    if not os.access(script, os.X_OK):
        pytest.skip(f"no pytest console script beside {sys.executable}")
    pytester.makepyfile(
        token="def make_token():\n    return 'abc'\n",
        json="def parse(text):\n    return text\n",
        test_project=SHADOWED_SUITE,
    )
    # Not pytester.run: it puts the directory on PYTHONPATH, where pytest itself would
    # import the project's token.py.
    run = subprocess.run(
        [script, "-p", "no:cacheprovider", "-p", "no:asyncio"],
        cwd=pytester.path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.stderr == ""
    result = pytest.RunResult(run.returncode, run.stdout.splitlines(), [], 0.0)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*scope 'test_hangs::call' expired after 0.5*interrupted*"])
    result.stdout.no_fnmatch_line("*watchdog lost*")


NESTED_SUITE = '''
import ctypes
import gc
import os
import signal
import os
import sys
import threading

import pytest

INNER = """
import subprocess
import os
import sys

import pytest
import pytest_elastic_timer as et


def test_inner():
    with et.expires(30, scope="inner"):
        subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_expiry_caught():
    with pytest.raises(et.ScopeExpired) as caught:
        with et.expires(0.05, scope="short"):
            while True:
                pass
    # Kept past the session, with the frames of its traceback.
    sys.modules["test_nested"].KEPT.append(caught.value)
"""

KEPT = []


def _subreaper():
    flag = ctypes.c_int(0)
    ctypes.CDLL(None).prctl(37, ctypes.byref(flag), 0, 0, 0)
    return flag.value


def _caught():
    """The signals this process catches, as a mask. The C library's own (between the
    standard signals and SIGRTMIN) are left out: glibc starts catching them when the
    process first starts a thread, whoever starts it."""
    with open("/proc/self/status") as f:
        (line,) = [line for line in f if line.startswith("SigCgt:")]
    libc = sum(1 << (s - 1) for s in range(32, signal.SIGRTMIN))
    return int(line.split()[1], 16) & ~libc


def _files():
    found = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            found[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass  # the descriptor listdir itself used
    return found


def _sizes(files):
    sizes = {}
    for fd, target in files.items():
        try:
            sizes[fd] = os.fstat(fd).st_size
        except OSError:
            pass
    return sizes


def _dump_target():
    """Where a stack dump on the session's dump signal goes now (which descriptor)."""
    num = os.environ.get("PYTEST_ELASTIC_TIMER_DUMP_SIGNAL", "")
    if not num.isdigit() or not _caught() >> (int(num) - 1) & 1:
        return None  # not registered here (this process did not start in a session)
    files = _files()
    before = _sizes(files)
    signal.pthread_kill(threading.main_thread().ident, int(num))
    after = _sizes(files)
    return sorted(fd for fd in after if after[fd] > before.get(fd, 0))


def snapshot():
    gc.collect()
    env = dict(os.environ)
    # pytest itself (not the plugin) removes this at the end of the inner test.
    env.pop("PYTEST_CURRENT_TEST", None)
    return {
        "files": _files(),
        "env": env,
        "sys.path": list(sys.path),
        "path_hooks": list(sys.path_hooks),
        "meta_path": list(sys.meta_path),
        "handlers": {
            s: signal.getsignal(s)
            for s in signal.valid_signals()
            if s not in (signal.SIGKILL, signal.SIGSTOP)
        },
        "caught": _caught(),
        "dump goes to": _dump_target(),
        "threads": sorted(t.name for t in threading.enumerate()),
        "subreaper": _subreaper(),
        "children": sorted(os.listdir(f"/proc/self/task/{threading.get_native_id()}")),
    }


@pytest.mark.parametrize("scoped_before", [False, True])
def test_nested(pytester, scoped_before):
    if scoped_before:
        import pytest_elastic_timer as et
        from pytest_elastic_timer.scope.scopes import process_state

        with et.expires(30, scope="outer"):
            pass
        # The watchdog's answer, which the thread that stood by for it (the watchdog
        # loads late in a session that does not wait for it) ends with.
        process_state().watchdog_pid
        for thread in threading.enumerate():
            if thread.name.endswith("standby"):
                thread.join()
    pytester.makepyfile(test_inner=INNER)
    pytester.makeini("[pytest]\\n")
    before = snapshot()
    for _ in range(2):
        result = pytester.runpytest_inprocess(
            "-p", "elastic_timer", "-p", "no:cacheprovider", "-p", "no:asyncio"
        )
        result.assert_outcomes(passed=2)
    after = snapshot()
    assert after == before


def test_after():
    gc.collect()
'''


@pytest.mark.parametrize("outer", [[], ["-p", "no:elastic_timer"]], ids=["plugin", "no-plugin"])
def test_nested_session_leaves_the_process_as_found(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, outer: list[str]
) -> None:
    """Two in-process inner sessions with scopes, a child process and an expiry leave
    files, sockets, signal handlers and faulthandler registrations, environment,
    sys.path, atexit callbacks, threads and the subreaper flag as they found them."""
    pytester.makeini("[pytest]\nfilterwarnings = error\n")
    pytester.makepyfile(test_nested=NESTED_SUITE)
    result = pytester.runpytest_subprocess(
        "-p",
        "pytester",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:asyncio",
        *outer,
        "-W",
        "error::ResourceWarning",
    )
    result.assert_outcomes(passed=3)


SHADOWED_SITECUSTOMIZE = """
import os
import sys

sys.path.append("/nonexistent/added-by-the-shadowed-sitecustomize")


def _hook(path):
    raise ImportError("not for this hook")


_hook.added_by_shadowed = True
sys.path_hooks.append(_hook)
"""

CHAIN_SUITE = '''
import json
import os
import subprocess
import os
import sys

CHILD = """
import json
import os
import sys

print(json.dumps({
    "path": sys.path,
    "hooks": [getattr(h, "added_by_shadowed", False) for h in sys.path_hooks],
    "sitecustomize": getattr(sys.modules.get("sitecustomize"), "__file__", None),
}))
"""


def test_child_sees_what_the_shadowed_sitecustomize_did():
    out = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, check=True
    )
    seen = json.loads(out.stdout)
    startup = os.environ["PYTHONPATH"].split(os.pathsep)[0]
    assert startup.endswith("pythonpath")  # the session's start-up directory comes first
    assert "/nonexistent/added-by-the-shadowed-sitecustomize" in seen["path"]
    assert True in seen["hooks"]
    assert seen["sitecustomize"] == os.path.join(os.environ["SHADOWED"], "sitecustomize.py")
    assert startup not in seen["path"]
'''


def test_sitecustomize_chains_without_undoing_the_shadowed_one(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The session's sitecustomize runs the one it shadows and keeps what that one did
    to sys.path and the import system; only its own directory leaves sys.path."""
    shadowed = pytester.mkdir("shadowed")
    (shadowed / "sitecustomize.py").write_text(SHADOWED_SITECUSTOMIZE, encoding="utf-8")
    python_path = [str(shadowed), *filter(None, [os.environ.get("PYTHONPATH")])]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(python_path))
    monkeypatch.setenv("SHADOWED", str(shadowed))
    pytester.makepyfile(test_chain=CHAIN_SUITE)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:asyncio")
    result.assert_outcomes(passed=1)


OLD_PYTHONS = [
    os.path.expanduser(f"~/.pyenv/versions/{version}/bin/python")
    for version in ("2.7.18", "3.6.15")
]

OLD_PYTHON_SUITE = """
import os
import subprocess
import sys


def test_an_old_python_chains_to_the_shadowed_sitecustomize():
    run = subprocess.run(
        [os.environ["OLD_PYTHON"], "-c", "print('ok')"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        universal_newlines=True,
    )
    assert (run.stdout, run.stderr) == ("shadowed ran\\nok\\n", "")
"""


@pytest.mark.parametrize("python", OLD_PYTHONS, ids=["2.7", "3.6"])
def test_a_python_too_old_for_the_session_only_chains(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, python: str
) -> None:
    """A test may start any Python (a tool's test of Python 2.7, say): the session's
    sitecustomize is parsed by it without an error, and chains to the one it shadows."""
    if not os.path.exists(python):
        pytest.skip(f"no {python} here")
    shadowed = pytester.mkdir("shadowed")
    (shadowed / "sitecustomize.py").write_text("print('shadowed ran')\n", encoding="utf-8")
    python_path = [str(shadowed), *filter(None, [os.environ.get("PYTHONPATH")])]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(python_path))
    monkeypatch.setenv("OLD_PYTHON", python)
    pytester.makepyfile(test_old=OLD_PYTHON_SUITE)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:asyncio")
    result.assert_outcomes(passed=1)


COVERED_SUITE = """
import subprocess
import sys


def test_child():
    subprocess.run([sys.executable, "child.py"], check=True)
"""


def test_coverage_of_subprocesses_leaves_the_start_up_file_out(
    pytester: pytest.Pytester,
) -> None:
    """coverage.py measuring subprocesses (``patch = subprocess``, as pytest-cov 7 does)
    and no ``source``: the children's start-up file is not a file of the session (it
    would be counted in the total and missing once the session is gone), and the report
    runs after the session."""
    coverage = pytest.importorskip("coverage", reason="needs coverage.py")
    if tuple(int(n) for n in coverage.__version__.split(".")[:2]) < (7, 10):
        pytest.skip("coverage.py 7.10 measures subprocesses with patch = subprocess")
    (pytester.path / ".coveragerc").write_text("[run]\npatch = subprocess\n")
    pytester.makepyfile(child="x = 1\n", test_covered=COVERED_SUITE)
    with top_level_environment():
        ran = pytester.run(
            sys.executable, "-m", "coverage", "run", "-m", "pytest",
            "-p", "elastic_timer", "-p", "no:cacheprovider", "-p", "no:asyncio",
            # A report to read back: pytest waits for its watchdog to end.
            "--elastic-timer-report=report.json", "test_covered.py",
        )  # fmt: skip
        ran.assert_outcomes(passed=1)
        # No data of the watchdog's: it is no process of the tests, and its data would
        # come after pytest-cov combined theirs (a stray file).
        (watchdog,) = re.findall(r"elastic-timer: watchdog pid (\d+)", ran.stdout.str())
        data = [p.name for p in pytester.path.glob(".coverage.*")]
        assert data and not [name for name in data if f".pid{watchdog}." in name], data
        pytester.run(sys.executable, "-m", "coverage", "combine")
        report = pytester.run(sys.executable, "-m", "coverage", "report")
    text = report.stdout.str() + report.stderr.str()
    assert report.ret == 0, text  # every measured file is still there
    assert "child.py" in text, text  # the child was measured
    assert "pytest-elastic-timer-" not in text, text  # nothing of a session directory
    # Installed from a wheel, the package (start-up file included) is third-party code
    # that coverage leaves out; installed for development, it is measured with the rest.
    package = os.path.dirname(pytest_elastic_timer.__file__)
    for line in text.splitlines():
        assert "sitecustomize" not in line or line.startswith(package), text


# Counting stand-ins for the names a test may patch, installed for the whole session
# (from the conftest, before any test): each call made with a frame of the package on
# the stack is written to $PATCHED_CALLS, then the real function runs.
PATCHING_CONFTEST = """
import builtins
import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid

PACKAGE = os.sep + "pytest_elastic_timer" + os.sep
_getpid = os.getpid
_open = open


def _from_the_package(direct, depth):
    frame = sys._getframe(depth)
    while frame is not None:
        if PACKAGE in frame.f_code.co_filename:
            return f"{frame.f_code.co_filename}:{frame.f_lineno}"
        if direct:
            return None
        frame = frame.f_back
    return None


def _counting(name, real, direct=False, depth=2):
    # direct: only the package's own calls count, not those of what it calls (the
    # standard library reads the pid for its own bookkeeping: tempfile, say).
    def stand_in(*args, **kwargs):
        where = _from_the_package(direct, depth)
        if where is not None:
            with _open(os.environ["PATCHED_CALLS"], "a", encoding="utf-8") as f:
                f.write(f"{_getpid()} {name} from {where}\\\\n")
        return real(*args, **kwargs)

    return stand_in


# What freezegun does while a test freezes time: every module attribute that *is*
# time.time or time.monotonic, in every module loaded (here: the package's), is replaced.
_frozen = {
    id(time.time): _counting("time.time (a module's own)", time.time),
    id(time.monotonic): _counting("time.monotonic (a module's own)", time.monotonic),
}
for _module_name, _module in list(sys.modules.items()):
    if _module_name.startswith("pytest_elastic_timer"):
        for _attribute, _value in list(vars(_module).items()):
            if id(_value) in _frozen:
                setattr(_module, _attribute, _frozen[id(_value)])

time.sleep = _counting("time.sleep", time.sleep)
time.time = _counting("time.time", time.time)
time.monotonic = _counting("time.monotonic", time.monotonic)
os.kill = _counting("os.kill", os.kill)
os.getpid = _counting("os.getpid", os.getpid, direct=True)
for _name in ("run", "call", "check_call", "check_output"):
    setattr(subprocess, _name, _counting(f"subprocess.{_name}", getattr(subprocess, _name)))


class _CountingPopen(subprocess.Popen):
    def __init__(self, *args, **kwargs):
        _counting("subprocess.Popen", lambda: None)()
        super().__init__(*args, **kwargs)


subprocess.Popen = _CountingPopen


# What pytest-socket does: --disable-socket replaces the class socket.socket during each
# test, --allow-hosts replaces its connect method.
class _CountingSocket(socket.socket):
    def __init__(self, *args, **kwargs):
        _counting("socket.socket", lambda: None)()
        super().__init__(*args, **kwargs)


_Socket = socket.socket
_Socket.connect = _counting("socket.socket.connect", _Socket.connect)
socket.socket = _CountingSocket
socket.socketpair = _counting("socket.socketpair", socket.socketpair)

# What a test does that forbids file access or threads, or fakes JSON (direct: the
# standard library's own calls through these names do not count).
builtins.open = _counting("open", open, direct=True)
json.dumps = _counting("json.dumps", json.dumps, direct=True)
json.loads = _counting("json.loads", json.loads, direct=True)
threading.get_ident = _counting("threading.get_ident", threading.get_ident, direct=True)
# What a test does that fakes a directory or a file (direct: as above).
os.listdir = _counting("os.listdir", os.listdir, direct=True)
os.pread = _counting("os.pread", os.pread, direct=True)
# What a test does that wants fixed ids (direct: as above).
uuid.uuid4 = _counting("uuid.uuid4", uuid.uuid4, direct=True)


class _CountingThread(threading.Thread):
    def __init__(self, *args, **kwargs):
        _counting("threading.Thread", lambda: None, direct=True, depth=3)()
        super().__init__(*args, **kwargs)


class _CountingTimer(threading.Timer):
    def __init__(self, *args, **kwargs):
        _counting("threading.Timer", lambda: None, direct=True, depth=3)()
        super().__init__(*args, **kwargs)


threading.Thread = _CountingThread
threading.Timer = _CountingTimer
"""

PATCHED_SUITE = '''
import subprocess
import sys
import threading

import pytest
import pytest_elastic_timer as et

# A library's thread, alive through every test: the leak check then reads the children
# of every thread, not the main one's alone.
threading.Thread(target=threading.Event().wait, daemon=True).start()

INNER = """
import subprocess
import sys

import pytest
import pytest_elastic_timer as et


@pytest.mark.expires(30)
def test_inner_leaves_a_process():
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    with et.expires(30, scope="inner"):
        pass
"""


def test_scopes_and_an_expiry():
    with et.expires(30, scope="outer"):
        with et.expires(20, scope="inner"):
            pass
    with pytest.raises(et.ScopeExpired):
        with et.expires(0.05, scope="short"):
            while True:
                pass


@pytest.mark.expires(1)
def test_fails_by_its_budget():
    while True:
        pass


def test_leaves_a_process_the_plugin_ends():
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_nested_session(pytester):
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest_inprocess(
        "-p", "no:cacheprovider", "-p", "no:asyncio", "--elastic-timer-leaks=kill"
    )
    result.assert_outcomes(passed=1, warnings=1)


def test_after():
    pass
'''


@pytest.mark.parametrize("workers", [[], ["-p", "xdist", "-n", "2"]], ids=["one", "xdist"])
def test_nothing_goes_through_names_a_test_may_patch(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, workers: list[str]
) -> None:
    """time.sleep, time.time, time.monotonic (also where a module of the package holds
    them, as freezegun replaces them there), os.kill, os.getpid, subprocess's functions, and
    socket.socket, its connect and socket.socketpair (as pytest-socket replaces them),
    open, json.dumps and json.loads, threading.Thread, threading.Timer,
    threading.get_ident and uuid.uuid4, replaced for a whole session (scopes, an expiry
    caught and one that fails its test, a leftover process the plugin ends, a nested
    session that starts its own watchdog for its test's budget and stops it, xdist), are
    never called by the plugin in a test's process."""
    calls = pytester.path / "calls.txt"
    monkeypatch.setenv("PATCHED_CALLS", str(calls))
    pytester.makeconftest(PATCHING_CONFTEST)
    pytester.makepyfile(test_patched=PATCHED_SUITE)
    result = pytester.runpytest_subprocess(
        "-p",
        "pytester",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:asyncio",
        "--elastic-timer-leaks=kill",
        *workers,
    )
    result.assert_outcomes(passed=4, failed=1, warnings=1)
    result.stdout.fnmatch_lines(["*scope 'test_fails_by_its_budget::call' expired after*"])
    assert not calls.exists(), calls.read_text(encoding="utf-8")


ABANDONING_SUITE = '''
import os

INNER = """
import os


def test_ends_pytest_at_once():
    os._exit(0)
"""


def test_inner_pytest_ends_through_os_exit(pytester):
    pytester.makepyfile(test_inner=INNER)
    report = os.environ["INNER_REPORT"]
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-p", "no:asyncio", f"--elastic-timer-report={report}"
    )
    assert result.ret == 0


def test_after():
    pass
'''


@pytest.mark.parametrize("mode", ["kill", "warn"])
def test_the_leak_check_leaves_an_inner_sessions_watchdog_alone(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """An inner pytest (run by a test) that ends through os._exit leaves its watchdog to
    the test process, which adopted it (subreaper): the leak check knows the plugin's
    own machinery and neither ends it nor warns; the watchdog ends by itself and writes
    the inner session's report."""
    report = pytester.path / "inner-report.json"
    monkeypatch.setenv("INNER_REPORT", str(report))
    pytester.makepyfile(test_abandon=ABANDONING_SUITE)
    result = pytester.runpytest_subprocess(
        "-p",
        "pytester",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:asyncio",
        f"--elastic-timer-leaks={mode}",
        "-W",
        "error::pytest.PytestWarning",
    )
    result.assert_outcomes(passed=2)
    assert "left 1 process" not in result.stdout.str()
    deadline = time.monotonic() + 10.0
    while not report.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    session = json.loads(report.read_text(encoding="utf-8"))["session"]
    assert session["root_died"] is True


SESSION_COUNTING_CONFTEST = """
from pytest_elastic_timer.plugin import lifecycle


def pytest_configure(config):
    print(f"ends with its process: {lifecycle.ends_with_its_process(config)}")
"""

RUNS_AN_INNER_SESSION = """
import pathlib

import pytest

pytest_plugins = ["pytester"]


def test_inner(pytester):
    pytester.makeconftest((pathlib.Path(__file__).parent / "conftest.py").read_text())
    pytester.makepyfile(test_one="def test_one():\\n    pass\\n")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-s")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["ends with its process: False"])


def test_a_helper(pytester, capsys):
    pytester.makeconftest((pathlib.Path(__file__).parent / "conftest.py").read_text())
    capsys.readouterr()
    pytester.parseconfigure()
    assert capsys.readouterr().out == "ends with its process: False\\n"
"""


def test_only_the_outermost_session_ends_with_its_process(pytester: pytest.Pytester) -> None:
    """The command line's session need not wait for its watchdog's end (the process
    exits); a session run in-process by a test waits, to leave no child behind, and so
    does pytester's parseconfigure(), which configures pytest without a session."""
    pytester.makeconftest(SESSION_COUNTING_CONFTEST)
    pytester.makepyfile(test_outer=RUNS_AN_INNER_SESSION)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-s")
    result.assert_outcomes(passed=2)
    assert result.stdout.str().count("ends with its process: True") == 1


ON_DEMAND_OUTER = '''
import os

import psutil

pytest_plugins = ["pytester"]

INNER_PLAIN = """
import os
import subprocess
import sys

import pytest
import pytest_elastic_timer as et

CHILD = (
    "import pytest_elastic_timer as et\\\\n"
    "try:\\\\n"
    "    with et.expires(0.05, scope='child'):\\\\n"
    "        while True:\\\\n"
    "            pass\\\\n"
    "except et.ScopeExpired:\\\\n"
    "    raise SystemExit(3)\\\\n"
)


def test_sees_no_watchdog():
    assert "PYTEST_ELASTIC_TIMER" not in os.environ


def test_a_scope_is_enforced_in_process():
    with pytest.raises(et.ScopeExpired):
        with et.expires(0.05, scope="in-process"):
            while True:
                pass


def test_a_child_enforces_its_scopes_itself():
    assert subprocess.run([sys.executable, "-c", CHILD]).returncode == 3
"""

INNER_BUDGET = """
import os

import pytest


@pytest.mark.expires(0.3)
def test_overruns():
    print("inner address", os.environ["PYTEST_ELASTIC_TIMER"])
    while True:
        pass
"""

INNER_WORKER = """
import os
import pathlib


def test_in_a_worker():
    seen = pathlib.Path(__file__).parent / "seen.txt"
    seen.write_text(os.environ.get("PYTEST_ELASTIC_TIMER", ""), encoding="utf-8")
"""

FAILING_START = """
from pytest_elastic_timer.plugin import launcher

real_start = launcher.start


def cannot_start(**kwargs):
    raise OSError("no watchdog here")


def pytest_configure(config):
    launcher.start = cannot_start


def pytest_unconfigure(config):
    launcher.start = real_start
"""

INNER_ON_ITS_OWN = """
import os

import pytest
import pytest_elastic_timer as et
from pytest_elastic_timer.scope import scopes


@pytest.mark.expires(30)
def test_on_its_own():
    assert "PYTEST_ELASTIC_TIMER" not in os.environ
    assert scopes.current_state().sock is None  # not the outer session's connection
    with pytest.raises(et.ScopeExpired):
        with et.expires(0.05, scope="in-process"):
            while True:
                pass
"""

INNER_FIXTURE = """
def test_asks_for_the_watchdog(elastic_timer_server):
    print("inner watchdog", elastic_timer_server.pid, elastic_timer_server.address)
"""


def run_inner(pytester, source):
    pytester.makepyfile(test_inner=source)
    return pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:asyncio", "-s")


def test_a_session_that_needs_nothing_starts_no_watchdog(pytester):
    outer = os.environ["PYTEST_ELASTIC_TIMER"]
    before = set(psutil.Process().children(recursive=True))
    result = run_inner(pytester, INNER_PLAIN)
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(["elastic-timer: watchdog when a test needs one, *"])
    assert os.environ["PYTEST_ELASTIC_TIMER"] == outer
    assert set(psutil.Process().children(recursive=True)) <= before


def test_a_budget_starts_the_sessions_own_watchdog(pytester):
    outer = os.environ["PYTEST_ELASTIC_TIMER"]
    result = run_inner(pytester, INNER_BUDGET)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*scope 'test_overruns::call' expired after*"])
    (line,) = [text for text in result.stdout.lines if "inner address " in text]
    assert line.split("inner address ", 1)[1] not in ("", outer)
    assert os.environ["PYTEST_ELASTIC_TIMER"] == outer


def test_xdist_workers_start_it_at_once(pytester):
    outer = os.environ["PYTEST_ELASTIC_TIMER"]
    pytester.makepyfile(test_inner=INNER_WORKER)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "xdist", "-n", "1")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["elastic-timer: watchdog pid *"])
    assert (pytester.path / "seen.txt").read_text(encoding="utf-8") not in ("", outer)
    assert os.environ["PYTEST_ELASTIC_TIMER"] == outer


def test_one_that_cannot_start_leaves_the_session_on_its_own(pytester):
    from pytest_elastic_timer.scope import scopes

    outer, state = os.environ["PYTEST_ELASTIC_TIMER"], scopes.current_state()
    pytester.makeconftest(FAILING_START)
    result = run_inner(pytester, INNER_ON_ITS_OWN)
    result.assert_outcomes(passed=1, warnings=1)
    result.stdout.fnmatch_lines(["*no watchdog here; scopes are enforced in-process only*"])
    assert os.environ["PYTEST_ELASTIC_TIMER"] == outer
    assert scopes.current_state() is state


def test_a_fixture_of_the_plugin_starts_it(pytester, elastic_timer_server):
    result = run_inner(pytester, INNER_FIXTURE)
    result.assert_outcomes(passed=1)
    (line,) = [text for text in result.stdout.lines if "inner watchdog " in text]
    pid, address = line.split("inner watchdog ", 1)[1].split()
    assert int(pid) not in (0, elastic_timer_server.pid)
    assert address != elastic_timer_server.address
    assert not psutil.pid_exists(int(pid))
'''


def run_outer(pytester: pytest.Pytester, source: str, passed: int) -> list[str]:
    """Run ``source``, a test module whose tests run sessions in-process, in a pytest
    of its own that writes a JSON report; its tests all pass, and every process the run
    started is gone. Returns the scopes of the report's records."""
    pytester.makepyfile(test_outer=source)
    report = pytester.path / "outer.json"
    before = set(psutil.Process().children(recursive=True))
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-p", "no:asyncio", f"--elastic-timer-report={report}"
    )
    result.assert_outcomes(passed=passed)
    started = set(psutil.Process().children(recursive=True)) - before
    assert all(wait_gone(p.pid, 5.0) for p in started), started
    expired = json.loads(report.read_text(encoding="utf-8"))["expired"]
    return sorted(record["scope"] for record in expired)


def test_a_session_run_in_process_starts_its_watchdog_when_a_test_needs_one(
    pytester: pytest.Pytester,
) -> None:
    """A session that a test runs in-process, with no option of the plugin, starts no
    watchdog while none of its tests has a budget or asks for a fixture of the plugin:
    its scopes and its children's are enforced in-process, and none reaches the outer
    session's watchdog. A budget, or the fixture, starts the session's own; xdist
    workers start it at once. One that cannot start leaves the session on its own, and
    the outer session's state and environment as they were."""
    assert run_outer(pytester, ON_DEMAND_OUTER, passed=5) == []


NAMED_AS_ITS_OWN_OUTER = '''
import pytest
import pytest_elastic_timer as et

pytest_plugins = ["pytester"]

INNER = """
import time

import pytest
import pytest_elastic_timer as et


@pytest.mark.expires(30)
def test_budgeted():
    with et.expires(0.2, scope="step"):
        time.sleep(30)


def test_plain():
    with et.expires(0.2, scope="step"):
        time.sleep(30)


@pytest.mark.expires(0.2)
def test_phase():
    time.sleep(30)
"""

NAMES = ["test_budgeted::call/step", "test_plain::call/step", "test_phase::call"]

# Between its tests, the inner session's table names none (not the outer test).
BETWEEN_TESTS = """
from pytest_elastic_timer.scope import scopes


def pytest_runtest_logfinish(nodeid, location):
    with open("between.txt", "a", encoding="utf-8") as file:
        file.write(repr(scopes.process_state().nodeid) + "\\\\n")
"""


def run_inner(pytester):
    pytester.makepyfile(test_inner=INNER)
    pytester.makeconftest(BETWEEN_TESTS)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:asyncio")
    result.assert_outcomes(failed=3)
    between = (pytester.path / "between.txt").read_text(encoding="utf-8")
    assert between.splitlines() == ["''"] * 3, between
    for name in NAMES:
        result.stdout.fnmatch_lines([f"E *ScopeExpired: scope '{name}' expired after *"])
        result.stdout.fnmatch_lines([f"TIMEOUT * - scope '{name[:20]}*"])
    assert "test_outer_plain::" not in result.stdout.str()
    assert "test_outer_budgeted::" not in result.stdout.str()
    # Its own watchdog recorded them: its summary lists them.
    summary = result.stdout.str().split("elastic-timer: expired scopes", 1)[1]
    listed = [line.split("'")[1] for line in summary.splitlines() if line.startswith("scope '")]
    assert listed == NAMES
    # The outer test's own scopes are named after it again.
    with pytest.raises(et.ScopeExpired) as caught:
        with et.expires(0.05, scope="after"):
            while True:
                pass
    return caught.value.scope


def test_outer_plain(pytester):
    assert run_inner(pytester) == "test_outer_plain::call/after"


@pytest.mark.expires(60)
def test_outer_budgeted(pytester):
    assert run_inner(pytester) == "test_outer_budgeted::call/after"
'''


def test_a_session_run_in_process_names_its_scopes_as_a_session_of_its_own(
    pytester: pytest.Pytester,
) -> None:
    """The scopes of a session that a test runs in-process are not named below that
    test's phase, whether it has a budget (a scope open below the inner session's) or
    not, and they are the inner session's watchdog's: its summary lists them, the outer
    session's report does not. Between its tests its table names no test. The outer
    test's scopes are named after it again afterwards, and enforced by the outer
    watchdog."""
    assert run_outer(pytester, NAMED_AS_ITS_OWN_OUTER, passed=2) == [
        "test_outer_budgeted::call/after",
        "test_outer_plain::call/after",
    ]


PAUSED_INSIDE_OUTER = '''
import pytest

pytest_plugins = ["pytester"]

INNER = """
import time

import pytest_elastic_timer as et
from pytest_elastic_timer.scope import scopes


def test_paused():
    with et.expires(1.0, scope="inner") as timer:
        deadline = timer.deadline
        scopes.suspend()  # what entering pdb does
        try:
            time.sleep(2.0)
        finally:
            scopes.resume()
        assert timer.deadline >= deadline + 2.0
"""


@pytest.mark.expires(1.5)
def test_outer(pytester):
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest_inprocess(
        "-p", "no:cacheprovider", "-p", "no:asyncio", "--expires=30"
    )
    result.assert_outcomes(passed=1)
'''


def test_a_debugger_pause_inside_a_session_run_in_process_pauses_the_outer_test_too(
    pytester: pytest.Pytester,
) -> None:
    """A debugger that holds a test of a session run in-process (one with its own
    watchdog) pauses the deadlines of the outer test too, which its outer watchdog
    enforces: the outer test is neither interrupted nor ended while it is paused."""
    assert run_outer(pytester, PAUSED_INSIDE_OUTER, passed=1) == []


NODE_HELPERS_OUTER = '''
import os
import time

import pytest
import pytest_elastic_timer as et
from _pytest.runner import runtestprotocol
from pytest_elastic_timer.scope import scopes

pytest_plugins = ["pytester"]

SOURCE = """
import time

import pytest


@pytest.fixture
def slow():
    time.sleep(30)


@pytest.mark.expires(30, setup=0.3)
def test_slow_setup(slow):
    pass
"""


def hang(name):
    with pytest.raises(et.ScopeExpired) as caught:
        with et.expires(0.05, scope=name):
            while True:
                pass
    return caught.value.scope


def test_plain(pytester):
    address = os.environ["PYTEST_ELASTIC_TIMER"]
    pytester.getmodulecol(SOURCE, configargs=["--expires-session=0.2"])
    assert os.environ["PYTEST_ELASTIC_TIMER"] == address
    assert scopes.process_state().phase() == "call"  # not the helper's session hooks'
    time.sleep(0.4)  # no session budget of the helper's
    assert hang("after") == "test_plain::call/after"


@pytest.mark.expires(60)
def test_budgeted(pytester):
    address = os.environ["PYTEST_ELASTIC_TIMER"]
    pytester.getitems(SOURCE)
    assert os.environ["PYTEST_ELASTIC_TIMER"] == address
    assert hang("after") == "test_budgeted::call/after"


def test_runs_the_item_itself(pytester):
    setup = runtestprotocol(pytester.getitem(SOURCE, "test_slow_setup"), log=False)[0]
    assert setup.when == "setup" and setup.failed
    assert "test_slow_setup::setup' expired after" in str(setup.longrepr)
'''


def test_pytesters_node_helpers_leave_the_calling_test_its_scopes(
    pytester: pytest.Pytester,
) -> None:
    """pytester's getitem() and getitems() configure pytest inside the calling test
    and unconfigure it only at that test's teardown: until then the test's scopes are
    still its own (named after it, enforced by its session's watchdog, in its report;
    its phase is not the helper's session hooks', nor does a helper's session budget
    run), and items it runs itself keep their phase budgets (named below its own
    phase)."""
    assert run_outer(pytester, NODE_HELPERS_OUTER, passed=3) == [
        "test_budgeted::call/after",
        "test_plain::call/after",
        "test_runs_the_item_itself::call/test_slow_setup::setup",
    ]


NODE_HELPER_ADOPTING = """
from _pytest.runner import runtestprotocol

ITEM = (
    "from pytest_elastic_timer.plugin import leaks\\n\\n\\n"
    "def test_func():\\n    assert leaks.is_subreaper()\\n"
)


def test_runs_an_item_under_warn(pytester):
    pytester.makeini("[pytest]\\naddopts = --elastic-timer-leaks=warn\\n")
    item = pytester.getitem(ITEM)
    reports = runtestprotocol(item, log=False)
    assert [r.outcome for r in reports] == ["passed"] * 3, reports
"""


def test_an_item_that_a_test_runs_itself_adopts_orphans_under_warn(
    pytester: pytest.Pytester,
) -> None:
    """An item that pytester's getitem() built, which a test runs itself, under
    ``--elastic-timer-leaks=warn``: its process adopts orphans while its test runs,
    as in a session (the outer session adopts none here)."""
    pytester.makepyfile(test_outer=NODE_HELPER_ADOPTING)
    result = pytester.runpytest_subprocess(
        "-p", "pytester", "-p", "no:cacheprovider", "-p", "no:asyncio",
        "--elastic-timer-leaks=off",
    )  # fmt: skip
    result.assert_outcomes(passed=1)


# Another plugin's suite builds nodes with pytester's helpers, which run a session's
# start and finish hooks around a collection without running the session (pytest-xdist's
# own looponfail tests): the finishing session has no exit status of its own.
PYTESTER_NODE_HELPERS = """
pytest_plugins = "pytester"

SOURCE = "def test_func():\\n    assert 0\\n"


def test_getitem(pytester):
    assert pytester.getitem(SOURCE).name == "test_func"


def test_getitems_and_getmodulecol(pytester):
    assert [i.name for i in pytester.getitems(SOURCE)] == ["test_func"]
    assert pytester.getmodulecol(SOURCE).name.endswith(".py")


def test_getnode_and_getpathnode(pytester):
    path = pytester.makepyfile(SOURCE)
    config = pytester.parseconfigure(path)
    assert pytester.getnode(config, path) is not None
    assert pytester.getpathnode(path) is not None


def test_inline_genitems_and_inline_runsource(pytester):
    items, _ = pytester.inline_genitems(pytester.makepyfile(SOURCE))
    assert [i.name for i in items] == ["test_func"]
    pytester.inline_runsource(SOURCE).assertoutcome(failed=1)
"""


@pytest.mark.parametrize("workers", [[], ["-p", "xdist", "-n", "2"]], ids=["one", "xdist"])
def test_pytester_node_helpers_work_with_the_plugin(
    pytester: pytest.Pytester, workers: list[str]
) -> None:
    """pytester's getitem(), getitems(), getmodulecol(), getnode() and friends, which
    call pytest_sessionfinish for a session that never ran (it has no exitstatus):
    every one works in a suite where the plugin is installed, as without it."""
    pytester.makepyfile(test_helpers=PYTESTER_NODE_HELPERS)
    before = set(psutil.Process().children(recursive=True))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *workers)
    result.assert_outcomes(passed=4)
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()
    started = set(psutil.Process().children(recursive=True)) - before
    assert all(wait_gone(p.pid, 5.0) for p in started), started  # the watchdogs too


# Time frozen by freezegun and sockets blocked by pytest-socket, as a test suite that
# uses them does: scopes in the test, in a child process and in a forked one, an expiry,
# a session-wide event, and a nested session that starts its own watchdog.
FROZEN_BLOCKED_SUITE = '''
import multiprocessing
import os
import subprocess
import sys
import time

import pytest
import pytest_elastic_timer as et
from freezegun import freeze_time

# A deadline lost to the frozen clock fails the test instead of hanging the session.
pytestmark = pytest.mark.expires(20)

CHILD = """
import os
import pytest_elastic_timer as et
with et.expires(0.3, scope="child"):
    while True:
        os.times()
"""

INNER = """
import pytest_elastic_timer as et


def test_inner():
    with et.expires(30, scope="inner"):
        pass
"""


def _forked(queue):
    try:
        with et.expires(0.3, scope="forked"):
            while True:
                os.times()
    except et.ScopeExpired as exc:
        queue.put((exc.scope, exc.elapsed))


def test_a_deadline_in_frozen_time_is_on_the_real_clock():
    with freeze_time("2012-01-14"):
        with pytest.raises(et.ScopeExpired) as info:
            with et.expires(0.3, scope="frozen"):
                while True:
                    os.times()
    assert info.value.scope.endswith("/frozen")
    assert 0.3 <= info.value.elapsed < 5


def test_a_torch_clients_expiration_in_frozen_time_keeps_its_budget():
    # torch's expires() reads the test's time.time(), frozen here: the client turns the
    # expiration into a budget on that clock, and enforces it on the real one.
    client = et.TimerClient()
    with freeze_time("2012-01-14"):
        with pytest.raises(et.ScopeExpired) as info:
            try:
                client.acquire("frozen-torch", time.time() + 0.3)
                while True:
                    os.times()
            finally:
                client.release("frozen-torch")
    assert info.value.scope.endswith("frozen-torch")
    assert info.value.budget == pytest.approx(0.3) and 0.3 <= info.value.elapsed < 5


def test_moving_frozen_time_expires_nothing():
    with freeze_time("2012-01-14") as frozen:
        with et.expires(5, scope="moved"):
            frozen.tick(3600)
            frozen.move_to("1990-01-01")
        with et.expires(5, scope="after"):
            pass


def test_children_and_an_event():
    child = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True)
    assert child.returncode != 0 and "'child' expired" in child.stderr, child.stderr
    queue = multiprocessing.get_context("fork").Queue()
    forked = multiprocessing.get_context("fork").Process(target=_forked, args=(queue,))
    forked.start()
    scope, elapsed = queue.get(timeout=30)
    forked.join(30)
    assert scope.endswith("forked") and elapsed < 5
    event = et.Event("ready")
    event.set()
    assert event.wait(5)


def test_nested_session(pytester):
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:asyncio")
    result.assert_outcomes(passed=1)


@pytest.mark.expires(3)
def test_a_hang_with_time_frozen():
    with freeze_time("2012-01-14"):
        with et.expires(0.5, scope="hung"):
            while True:
                os.times()
'''


@pytest.mark.expires(120)  # a lost deadline fails here instead of hanging the suite
@pytest.mark.parametrize(
    "blocking",
    [["--disable-socket"], ["--allow-hosts=127.0.0.1"], ["--disable-socket", "-n", "2"]],
    ids=["disable-socket", "allow-hosts", "disable-socket-xdist"],
)
def test_frozen_time_and_blocked_sockets_change_nothing(
    pytester: pytest.Pytester, blocking: list[str]
) -> None:
    """Under freezegun's frozen clock and pytest-socket's blocked sockets, scopes expire
    on the real clock (after their budget, not never or at once), in the test, a child
    and a forked child, a session-wide event works, a nested session starts and stops
    its watchdog, and a hang is reported by its scope. A torch client's expiration time,
    a time.time() value on the test's frozen clock, keeps its budget."""
    pytest.importorskip("freezegun")
    pytest.importorskip("pytest_socket")
    pytester.makepyfile(test_frozen=FROZEN_BLOCKED_SUITE)
    result = pytester.runpytest_subprocess(
        "-p",
        "pytester",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:asyncio",
        "-p",
        "no:randomly",
        "-p",
        "xdist",
        *blocking,
    )
    result.assert_outcomes(passed=5, failed=1)
    hung = r"scope 'test_a_hang_with_time_frozen::call/hung' expired after 0\.\d\ds"
    result.stdout.re_match_lines([rf".*{hung} \(budget 0\.5s\): interrupted"])


# pyfakefs fakes the file system for the tests that ask for it: the plugin keeps the
# real one (an expiry's report, its ranks' rings, the leftover check, a forked child's
# table), and a test after them finds the plugin whole.
FAKED_FILESYSTEM_SUITE = """
import os
import subprocess
import sys

import pytest
import pytest_elastic_timer as et

pytestmark = pytest.mark.expires(20)


def _forked():
    try:
        with et.expires(0.3, scope="forked"):
            while True:
                os.times()
    except et.ScopeExpired as exc:
        os._exit(7 if exc.scope == "forked" and exc.elapsed < 5 else 8)
    os._exit(9)


@pytest.mark.expires(3)
def test_a_hang_with_the_file_system_faked(fs):
    fs.create_file("/data/x.txt", contents="x")
    with et.expires(0.3, scope="faked"):
        while True:
            os.times()


# Python 3.12+ warns of a fork in a process with threads (an xdist worker's own).
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_forked_child_with_the_file_system_faked(fs):
    # A bare fork: multiprocessing's own pipes do not survive a faked file system.
    pid = os.fork()
    if pid == 0:
        _forked()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 7


def test_leaves_a_process_with_the_file_system_faked(fs):
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


@pytest.mark.expires(3)
def test_a_hang_after_them():
    with et.expires(0.3, scope="after"):
        while True:
            os.times()
"""


@pytest.mark.expires(120)
@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one", "xdist"])
def test_a_faked_file_system_leaves_the_plugin_the_real_one(
    pytester: pytest.Pytester, workers: list[str]
) -> None:
    """With pyfakefs faking the file system in some tests, scopes in them and in a
    forked child expire and are reported, the leftover process is found and ended, and
    a later test's expiry is reported: no INTERNALERROR from a module of the plugin that
    was loaded while the file system was fake."""
    pytest.importorskip("pyfakefs")
    pytester.makepyfile(test_faked=FAKED_FILESYSTEM_SUITE)
    result = pytester.runpytest_subprocess(
        "-p",
        "no:cacheprovider",
        "-p",
        "no:asyncio",
        "-p",
        "xdist",
        "--elastic-timer-leaks=kill",
        *workers,
    )
    result.assert_outcomes(passed=2, failed=2, warnings=1)
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()
    for test, scope in [
        ("test_a_hang_with_the_file_system_faked", "faked"),
        ("test_a_hang_after_them", "after"),
    ]:
        result.stdout.fnmatch_lines(
            [f"*scope '{test}::call/{scope}' expired after 0.3*s (budget 0.3s)*"]
        )
    result.stdout.fnmatch_lines(["*test_leaves_a_process_with_the_file_system_faked left 1*"])


# pyfakefs through a fixture of the project's own, in its conftest: the tests never ask
# for pyfakefs's fixtures, yet their file system is faked.
FAKED_BY_A_CONFTEST = """
import pytest
from pyfakefs.fake_filesystem_unittest import Patcher


@pytest.fixture
def faked():
    with Patcher() as patcher:
        yield patcher.fs
"""

INSTALLED_NOT_USED = """
import sys


def test_nothing_of_the_plugin_is_loaded_for_it():
    assert "pyfakefs.fake_filesystem_unittest" in sys.modules  # its plugin is loaded
    assert "pytest_elastic_timer.watchdog.proctree" not in sys.modules
    assert "psutil" not in sys.modules
"""


def test_pyfakefs_installed_but_unused_costs_the_session_nothing(
    pytester: pytest.Pytester,
) -> None:
    """Installed, pyfakefs's plugin is loaded into every session: the plugin loads its
    first-use modules (and psutil) for it only where the tests use pyfakefs."""
    pytest.importorskip("pyfakefs")
    pytester.makepyfile(test_unused=INSTALLED_NOT_USED)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:asyncio")
    result.assert_outcomes(passed=1)


@pytest.mark.expires(120)
def test_pyfakefs_from_a_conftest_fixture_leaves_the_plugin_the_real_one(
    pytester: pytest.Pytester,
) -> None:
    """No test asks for pyfakefs's own fixtures; the conftest that names it is enough
    for the plugin to keep the real file system (the suite of the test above)."""
    pytest.importorskip("pyfakefs")
    pytester.makeconftest(FAKED_BY_A_CONFTEST)
    suite = FAKED_FILESYSTEM_SUITE.replace("(fs)", "(faked)").replace("fs.create", "faked.create")
    pytester.makepyfile(test_faked=suite)
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-p", "no:asyncio", "--elastic-timer-leaks=kill"
    )
    result.assert_outcomes(passed=2, failed=2, warnings=1)
    text = result.stdout.str() + result.stderr.str()
    assert "INTERNALERROR" not in text and "could not be added" not in text, text
    result.stdout.fnmatch_lines(["*scope 'test_a_hang_after_them::call/after' expired*"])


UNRAISABLE = """
import threading


class Leaky:
    def __del__(self):
        raise ValueError("boom in __del__")


def test_unraisable():
    Leaky()


def test_thread_exception():
    thread = threading.Thread(target=lambda: 1 / 0)
    thread.start()
    thread.join()
"""


def test_warnings_made_errors_in_a_test_point_at_pytest_not_at_the_plugin(
    pytester: pytest.Pytester,
) -> None:
    """An exception pytest turns into a failure after the test's call (unraisable, in
    a thread) passes through the plugin's wrappers of the phases: it is shown where it
    is without the plugin, not in the plugin's file."""
    pytester.makeini("[pytest]\nfilterwarnings = error\n")
    pytester.makepyfile(test_unraisable=UNRAISABLE)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:asyncio")
    result.assert_outcomes(failed=2)
    text = result.stdout.str()
    assert "PytestUnraisableExceptionWarning" in text, text
    assert "pytest_elastic_timer" not in text, text


WAITS_FOR_ALL_CHILDREN = """
import os
import subprocess

import psutil


def test_reaps_every_child():
    child = subprocess.Popen(["sleep", "0.2"])
    reaped = []
    while True:
        try:
            reaped.append(os.waitpid(-1, 0)[0])
        except ChildProcessError:
            break
    child.returncode = 0  # reaped above
    assert reaped == [child.pid]
    assert psutil.Process().children() == []
"""


def test_a_test_that_waits_for_all_its_processes_children_is_not_kept_waiting(
    pytester: pytest.Pytester,
) -> None:
    """The watchdog is no child of pytest: a test that waits for every child of its
    process (os.wait() until there is none) does not wait for it, all session long."""
    pytester.makepyfile(test_reaps=WAITS_FOR_ALL_CHILDREN)
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-p", "no:asyncio", "-W", "ignore::ResourceWarning", timeout=60
    )
    result.assert_outcomes(passed=1)


# A suite that never uses the plugin, one of whose tests leaves processes running on
# purpose (a server kept for later tests, say): a child, and a double-forked daemon.
LEAVES_PROCESSES = """
import os
import subprocess
import sys
import time

SERVERS = []


def test_starts_a_server():
    SERVERS.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
    daemon = subprocess.run(
        ["sh", "-c", "sleep 60 > /dev/null 2>&1 & echo $!"], capture_output=True, text=True
    )
    with open("daemon.pid", "w") as f:
        f.write(daemon.stdout.strip())


def test_uses_it():
    assert SERVERS[0].poll() is None
    with open("daemon.pid") as f:
        daemon = int(f.read())
    with open(f"/proc/{daemon}/stat") as f:
        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
    SERVERS[0].kill()
    SERVERS[0].wait()
    os.kill(daemon, 9)
    if ppid == os.getpid():
        os.waitpid(daemon, 0)
    # Orphaned, it went where it would go without the plugin: not to pytest.
    assert ppid != os.getpid()
"""


@pytest.mark.parametrize(
    "uses",
    ["nothing", "a marker", "an option", "a scope"],
    ids=["untouched", "marker", "option", "scope"],
)
def test_a_suite_that_does_not_use_the_plugin_may_leave_processes_running(
    pytester: pytest.Pytester, uses: str
) -> None:
    """A suite that never uses the plugin gets no leak warning (an error under
    ``filterwarnings = error``), no second's wait after such a test, and no subreaper:
    an orphan goes where it would go without the plugin. Once the session uses the
    plugin (a marker, one of its options, a scope), the default names them."""
    pytester.makeini("[pytest]\nfilterwarnings = error\n")
    source = LEAVES_PROCESSES
    if uses == "a marker":
        source = "import pytest\n" + source.replace(
            "def test_uses_it", "@pytest.mark.expires(30)\ndef test_uses_it"
        )
    if uses == "a scope":
        source = source.replace(
            "def test_starts_a_server():\n",
            "def test_starts_a_server():\n"
            "    import pytest_elastic_timer\n\n"
            "    with pytest_elastic_timer.expires(30, scope='start'):\n"
            "        pass\n",
        )
    pytester.makepyfile(test_leaves=source)
    extra = ["--elastic-timer-grace=2"] if uses == "an option" else []
    with top_level_environment():
        result = pytester.runpytest_subprocess(*LEAN, "-rA", *extra)
    if uses == "nothing":
        result.assert_outcomes(passed=2)
        assert "left 2 process(es) running" not in result.stdout.str()
    elif uses == "a scope":
        # Used from the scope on: the first test's leftover child is named (an error
        # under the strict ini); its orphan was gone before, where it goes without us.
        result.assert_outcomes(passed=2, errors=1)
        result.stdout.fnmatch_lines(["*test_starts_a_server left 1 process(es) running*"])
    else:
        # Used from the start: the first test's leftovers are named, and pytest
        # adopted the orphan.
        result.assert_outcomes(passed=1, failed=1, errors=1)
        result.stdout.fnmatch_lines(["*test_starts_a_server left 2 process(es) running*"])
