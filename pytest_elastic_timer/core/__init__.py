"""What every side of the session shares: the scope table, the wire format, expiry records
and the session's start-up hook.

Nothing here imports pytest or psutil: test processes, the watchdog and the plugin all
load it.
"""
