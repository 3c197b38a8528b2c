"""The scope side, loaded in every process that enters a scope (xdist workers, ranks,
helpers): ``expires()`` / ``TimerRequest``, delivery of ``ScopeExpired``, this process's
link to the watchdog, and compatibility with torch's timer clients.

Nothing here imports pytest or psutil.
"""
