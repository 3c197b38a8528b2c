"""The watchdog: one process per session, outside every test process, started with
``python -m pytest_elastic_timer.watchdog``. It holds every open scope of the session,
escalates against the owner of an expired one and records what happened.

The only side that imports psutil; it never imports pytest.
"""
