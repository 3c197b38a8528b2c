"""The pytest plugin ``elastic_timer``: the only part of the package that imports pytest.

:mod:`.hooks` is the plugin module pytest loads (entry point ``elastic_timer``); it
starts the watchdog (:mod:`.launcher`), bounds each test's phases, looks for processes a
test left behind (:mod:`.leaks`) and reports hung xdist workers by scope
(:mod:`.xdist_support`).
"""
