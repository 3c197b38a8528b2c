"""Deadline-aware barriers, events and locks across the session's processes: the client
calls (:mod:`.client`, in test processes) and their state and timeouts (:mod:`.server`,
an intake of the watchdog).
"""
