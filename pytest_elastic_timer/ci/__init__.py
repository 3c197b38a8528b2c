"""CI outputs: JUnit XML, GitHub Actions annotations, slow phases and the trace timeline,
and the JUnit file the watchdog writes when pytest itself was killed.
"""
