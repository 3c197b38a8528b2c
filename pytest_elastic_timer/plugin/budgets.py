"""Each test's phase budgets: read from its ``expires`` marker (or the default), kept in
one :class:`BudgetBook` per session, and scaled in one place (:meth:`BudgetBook.scaled`)
for everything the plugin reports. Scopes scale their own budgets when entered."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import pytest

from pytest_elastic_timer.core.seconds import parse_seconds

MARKER_KEYWORDS = ("seconds", "setup", "teardown", "grace")


class Budgets(NamedTuple):
    """One test's phase budgets in seconds (None = unbounded), before scaling."""

    setup: float | None
    call: float | None
    teardown: float | None
    grace: float | None

    @property
    def phased(self) -> bool:
        """Whether setup or teardown has a budget of its own."""
        return self.setup is not None or self.teardown is not None


ScaledBudgets = tuple[float | None, float | None, float | None]  # setup, call, teardown


def parse_marker(nodeid: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Budgets:
    """The budgets of ``@pytest.mark.expires(*args, **kwargs)`` on test ``nodeid``, or
    ValueError naming the test and the marker as written."""
    where = f"{nodeid}: @pytest.mark.expires({marker_arguments(args, kwargs)})"
    unknown = sorted(set(kwargs) - set(MARKER_KEYWORDS))
    if unknown:
        raise ValueError(
            f"{where}: unknown keyword {unknown[0]!r} (known: {', '.join(MARKER_KEYWORDS)})"
        )
    if len(args) > 1:
        raise ValueError(f"{where}: takes one positional argument (seconds)")
    if args and "seconds" in kwargs:
        raise ValueError(f"{where}: seconds given twice")
    if not args and "seconds" not in kwargs:
        raise ValueError(f"{where}: needs the number of seconds, e.g. expires(5)")
    raw = args[0] if args else kwargs["seconds"]
    seconds = parse_seconds(raw, f"{where}: seconds", allow_text=False)

    def keyword(name: str) -> float | None:
        value = kwargs.get(name)
        if value is None:
            return None
        return parse_seconds(value, f"{where}: {name}", allow_text=False) or None

    return Budgets(keyword("setup"), seconds or None, keyword("teardown"), keyword("grace"))


def marker_arguments(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
    """The marker's arguments as written: ``'abc', setup=2``."""
    return ", ".join([*map(_text, args), *(f"{k}={_text(v)}" for k, v in kwargs.items())])


def _text(value: object) -> str:
    """``repr(value)``, also for a value whose ``__repr__`` fails."""
    try:
        return repr(value)
    except Exception:
        return f"<{type(value).__name__} object>"


def find_marker(node: pytest.Item | pytest.Collector | None) -> pytest.Mark | None:
    """The closest ``expires`` marker of ``node``, from the node up."""
    while node is not None:
        for mark in node.own_markers:
            if mark.name == "expires":
                return mark
        node = node.parent
    return None


class BudgetBook:
    """The budgets of every test of the session: ``default`` for a test without a
    marker, and those of marked tests by item. ``on_phased`` is called once a test
    with a setup or teardown budget is found."""

    def __init__(self, default: Budgets, scale: float, on_phased: Callable[[], None]) -> None:
        self.default = default
        self.scale = scale
        self.on_phased = on_phased
        self.by_item: dict[pytest.Item, Budgets] = {}
        # Items whose marker is bad, with the error that names the test and the value:
        # the test alone fails, at its setup (:meth:`check`).
        self.errors: dict[pytest.Item, str] = {}
        # Scaled budgets of marked tests that ran in other processes (xdist workers).
        self.reported: dict[str, ScaledBudgets] = {}
        self.has_markers = False  # a test of this process has an expires marker

    def add_items(self, nodes: Iterable[Any]) -> None:
        """Give each item of ``nodes`` its budgets, or its error for a bad marker (an
        item read again takes its new ones); the marker of a parent is looked up once
        for its items, not once per item."""
        parent_seen: Any = self
        parent_mark: pytest.Mark | None = None
        for node in nodes:
            if not isinstance(node, pytest.Item):
                continue
            mark = next((m for m in node.own_markers if m.name == "expires"), None)
            if mark is None:
                if node.parent is not parent_seen:
                    parent_seen, parent_mark = node.parent, find_marker(node.parent)
                mark = parent_mark
            try:
                self.by_item[node] = self.default if mark is None else self._marked(node, mark)
                if self.errors:  # read again, and good now
                    self.errors.pop(node, None)
            except ValueError as exc:
                self.errors[node] = str(exc)

    def check(self, item: pytest.Item) -> None:
        """Fail the test at its setup if its marker is bad (the error names the test
        and the value)."""
        errors = self.errors
        if errors and item in errors:
            pytest.fail(errors[item], pytrace=False)

    def of(self, item: pytest.Item) -> Budgets:
        """The item's budgets; ValueError naming the test for bad input."""
        budgets = self.by_item.get(item)
        if budgets is None:
            error = self.errors.get(item) if self.errors else None
            if error is not None:  # its marker was read at collection, and is bad
                raise ValueError(error)
            # Not collected by this session's collection hooks.
            mark = find_marker(item)
            try:
                budgets = self.by_item[item] = (
                    self.default if mark is None else self._marked(item, mark)
                )
            except ValueError as exc:
                self.errors[item] = str(exc)
                raise
        return budgets

    def _marked(self, item: pytest.Item, mark: pytest.Mark) -> Budgets:
        """The budgets of ``item``'s marker, or ValueError naming the test and the
        marker, whatever the value's own methods raise."""
        self.has_markers = True
        try:
            budgets = parse_marker(item.nodeid, mark.args, mark.kwargs)
        except ValueError:
            raise
        except Exception as exc:  # a value whose own methods fail: still this test's
            raise ValueError(
                f"{item.nodeid}: @pytest.mark.expires"
                f"({marker_arguments(mark.args, mark.kwargs)}): "
                f"not a number of seconds ({type(exc).__name__})"
            ) from None
        if budgets.phased:
            self.on_phased()
        return budgets

    def scaled(self, budgets: Budgets) -> ScaledBudgets:
        """(setup, call, teardown) in seconds as the scopes enforce them."""
        scale = self.scale
        return tuple(  # type: ignore[return-value]
            None if b is None else b * scale
            for b in (budgets.setup, budgets.call, budgets.teardown)
        )

    def marked(self) -> dict[str, ScaledBudgets]:
        """Scaled budgets by node id of the tests whose budgets are not the default,
        those of this process and those other processes reported."""
        default = self.default
        found = dict(self.reported)
        for item, budgets in self.by_item.items():
            if budgets is not default:
                found[item.nodeid] = self.scaled(budgets)
        return found

    def default_call(self) -> float | None:
        """The scaled call budget of a test without a marker (None = unbounded)."""
        return self.scaled(self.default)[1]

    def any_budget(self) -> bool:
        """Whether any test of the session had a budget (a default, or its own)."""
        return self.default_call() is not None or bool(self.marked())

    def any_budget_among(self, items: Iterable[pytest.Item]) -> bool:
        """Whether any of ``items`` has a budget (a default, or its own marker's)."""
        if self.default_call() is not None:
            return True
        default, by_item = self.default, self.by_item
        return any(by_item.get(item, default) is not default for item in items)

    def clear(self) -> None:
        self.by_item.clear()
        self.errors.clear()
