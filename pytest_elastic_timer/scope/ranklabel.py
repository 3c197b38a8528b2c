"""The label ``rank N`` that ``init_process_group`` gives this process (its global rank).

The collectives recorder (:mod:`.collectives`) sets it; the scope side reads it and
names the process after it. It lives apart from the recorder so that a process that
never imports torch.distributed never loads the recorder.
"""

from __future__ import annotations

from collections.abc import Callable

# "rank N" once this process called init_process_group, else "".
label = ""
# Called with the label when it is set.
listeners: list[Callable[[str], None]] = []


# The label the process gave itself (``set_label``), "" without one: the recorder's
# ring says it instead of ``rank N``, so that the other ranks' records name it so too.
own = ""
# Called with it when it is given.
own_listeners: list[Callable[[str], None]] = []


def set_label(value: str) -> None:
    """This process is ``value`` (``rank N``; "" once it left its group); tell the
    listeners."""
    global label
    label = value
    _tell(listeners, value)


def set_own(value: str) -> None:
    """The process named itself ``value``; tell the listeners."""
    global own
    own = value
    _tell(own_listeners, value)


def _tell(told: list[Callable[[str], None]], value: str) -> None:
    for listener in list(told):
        try:
            listener(value)
        except Exception:  # a label is worth less than the user's init
            pass


def forget() -> None:
    """A forked child is no rank until it joins a group itself, and has no label of its
    own until it sets one."""
    global label, own
    label = own = ""
