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


def set_label(value: str) -> None:
    """This process is ``value`` (``rank N``); tell the listeners."""
    global label
    label = value
    for listener in list(listeners):
        try:
            listener(value)
        except Exception:  # a label is worth less than the user's init
            pass


def forget() -> None:
    """A forked child is no rank until it joins a group itself."""
    global label
    label = ""
