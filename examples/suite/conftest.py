"""Demo suite: every test marked `hangs` is meant to hang and be caught."""

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "hangs(scope): this demo test hangs in `scope`")
