"""Test support that the tests and the tools share, not production code: hostile HTTP clients and failing
prefill peers, a link-shaping proxy and its rate traces, a metrics scrape and the near-tie agreement check.

Nothing in the package outside ``edgedecode.testing`` may import it (``lint-imports``, pyproject.toml); it may
import anything, the numpy reference (the test oracle) included.
"""
