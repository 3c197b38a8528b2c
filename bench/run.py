"""Run every benchmark of pytest-elastic-timer and write one Markdown report.

    python bench/run.py [--quick] [--only scope_cost,latency] [--docs]

Each benchmark runs in a fresh interpreter of its own, one after the other (so none
disturbs another's timings); the report goes to ``bench/results/latest.md`` (and the raw
numbers to ``bench/results/latest.json``) and is printed. ``--docs`` also copies it into
``docs/benchmarks.md`` between its ``bench:begin``/``bench:end`` markers. Not part of
the test suite: nothing here passes or fails a build.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common

BENCHMARKS = {
    "scope_cost": "1. Scope enter+exit",
    "per_test": "2. Per-test overhead",
    "latency": "3. Expiry latency",
    "watchdog_load": "4. Watchdog idle CPU, throughput and memory",
    "load": "5. Many processes with nested scopes and expiries",
    "startup": "6. Start-up: a one-test session",
    "collectives": "7. Collectives recorder: cost per op",
}
TIMEOUTS = {
    "scope_cost": 300,
    "per_test": 2400,  # five heap layouts of four configurations under valgrind
    "latency": 300,
    "watchdog_load": 300,
    "load": 300,
    "startup": 300,
    "collectives": 300,
}
RESULTS = os.path.join(common.BENCH_DIR, "results")
DOCS = os.path.join(common.REPO, "docs", "benchmarks.md")
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"


def _load() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "n/a"


def run_one(name: str, quick: bool) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    argv = [common.PYTHON, os.path.join(common.BENCH_DIR, f"{name}.py"), "--json-out", out]
    if quick:
        argv.append("--quick")
    start = time.monotonic()
    proc = subprocess.Popen(argv, env=common.clean_env(), start_new_session=True)
    try:
        code = proc.wait(TIMEOUTS[name] * (0.5 if quick else 1))
    except subprocess.TimeoutExpired:
        code = None
    finally:
        common.kill_group(proc)
    seconds = time.monotonic() - start
    try:
        with open(out) as f:
            result: dict[str, Any] = json.load(f)
        error = None if code == 0 else f"exit code {code}"
    except (OSError, ValueError):
        result, error = {}, ("timed out" if code is None else f"exit code {code}, no result")
    finally:
        if os.path.exists(out):
            os.unlink(out)
    return {"result": result, "error": error, "seconds": seconds}


def report(runs: dict[str, dict[str, Any]], info: dict[str, Any], quick: bool) -> str:
    sections: list[str] = []
    checks: list[dict[str, Any]] = []
    for name, run in runs.items():
        title = BENCHMARKS[name]
        body = ""
        if run["result"]:
            try:
                module = importlib.import_module(name)
                body, found = module.render(run["result"])
                checks.extend(found)
            except Exception as exc:  # a result of an older shape, a missing field
                body = f"(cannot render: {type(exc).__name__}: {exc})"
        if run["error"]:
            body = f"**Failed: {run['error']}.**\n\n" + body
        sections.append(f"### {title}\n\n{body}\n\n_{run['seconds']:.0f} s_")
    lines = ["| Target | Measured | Met |", "| --- | --- | --- |"]
    lines += [f"| {c['target']} | {c['measured']} | {common.verdict(c['ok'])} |" for c in checks]
    head = [
        f"Run of {time.strftime('%Y-%m-%d %H:%M %Z')}"
        + (" with `--quick`" if quick else "")
        + f", {sum(r['seconds'] for r in runs.values()):.0f} s in all; load average "
        f"{info['load_before']} before, {info['load_after']} after.",
        "",
        common.render_machine(info),
        "",
        "### Targets",
        "",
        "\n".join(lines),
    ]
    return "\n".join(head) + "\n\n" + "\n\n".join(sections) + "\n"


def update_docs(text: str) -> None:
    with open(DOCS) as f:
        doc = f.read()
    if BEGIN not in doc or END not in doc:
        raise SystemExit(f"{DOCS} has no {BEGIN} ... {END} section")
    before, rest = doc.split(BEGIN, 1)
    _, after = rest.split(END, 1)
    with open(DOCS, "w") as f:
        f.write(f"{before}{BEGIN}\n{text}{END}{after}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples, under 2 minutes")
    parser.add_argument("--only", default="", help="comma-separated benchmark names")
    parser.add_argument("--docs", action="store_true", help="also update docs/benchmarks.md")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n] or list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; known: {', '.join(BENCHMARKS)}")
    common.scrub_own_env()
    info = common.machine()
    info["load_before"] = _load()
    runs = {}
    for name in names:
        print(f"running {name} ...", file=sys.stderr, flush=True)
        runs[name] = run_one(name, args.quick)
        print(f"  {runs[name]['seconds']:.0f} s", file=sys.stderr, flush=True)
    info["load_after"] = _load()
    text = report(runs, info, args.quick)
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "latest.md"), "w") as f:
        f.write(text)
    with open(os.path.join(RESULTS, "latest.json"), "w") as f:
        json.dump({"machine": info, "runs": runs, "quick": args.quick}, f, indent=1)
    if args.docs:
        update_docs(text)
    print(text)
    return 0 if all(r["error"] is None for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
