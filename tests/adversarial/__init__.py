"""The watchdog under attack, faults, bad input: tests that prove what was not lost."""
