"""CI outputs: enriched JUnit XML, GitHub Actions annotations and step summary,
trace timeline, slow-scope warnings. A pytest plugin module registered by
:mod:`.plugin` in ``pytest_configure``.
"""

from __future__ import annotations
