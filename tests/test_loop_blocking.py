"""No blocking call on the servers' event loops, where a static check can see one (tests/loop_blocking.py):
every ``async def`` of the daemon, the shared serving plumbing and the prefill server, followed into the
package's functions it calls. ruff's ASYNC2 rules catch such calls written straight into an ``async def``;
this follows the sync helpers and the owners' methods in between. What neither can see (a callback, a call
through a protocol) is left to the runtime check under asyncio's debug mode."""

from __future__ import annotations

import textwrap
from pathlib import Path

from loop_blocking import find_blocking

ROOT = Path(__file__).resolve().parent.parent
CHECKED = ["edgedecode/daemon", "edgedecode/serving", "edgedecode/prefill/server.py"]

# (file, async def, blocking call) -> why the loop may run it: cheap enough, and measured so.
CHEAP: dict[tuple[str, str, str], str] = {}

# (file, async def, blocking call) -> the issue that moves it off the loop. Each entry is a known defect, listed
# so that the check holds everything else meanwhile; once fixed, the entry goes stale and this test says so.
KNOWN: dict[tuple[str, str, str], str] = {}


def test_no_async_def_of_the_servers_blocks_its_loop_beyond_the_listed_exceptions():
    findings = {(f.file, f.function, f.call): f for f in find_blocking(ROOT, "edgedecode", CHECKED)}
    unexpected = [str(finding) for key, finding in findings.items() if key not in CHEAP and key not in KNOWN]
    assert not unexpected, "blocking calls on the event loop (run them on an executor):\n" + "\n".join(unexpected)
    stale = sorted((CHEAP.keys() | KNOWN.keys()) - findings.keys())
    assert not stale, f"no longer found, remove from CHEAP / KNOWN: {stale}"


def write(root: Path, name: str, source: str) -> None:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source))


def test_a_deliberately_blocking_example_is_found_through_its_helpers(tmp_path):
    write(tmp_path, "pkg/__init__.py", "")
    write(
        tmp_path,
        "pkg/store.py",
        """
        import zstandard

        class Store:
            def squeeze(self) -> bytes:
                for rung in (self._retier,):  # dispatch over bound methods still runs them here
                    return rung()

            def _retier(self) -> bytes:
                return zstandard.ZstdCompressor(level=3).compress(b"kv" * 1000)
        """,
    )
    write(
        tmp_path,
        "pkg/server.py",
        """
        import asyncio
        import time
        from pathlib import Path

        from pkg.store import Store

        class Service:
            def __init__(self) -> None:
                self.store = Store()

            async def squeezes_on_the_loop(self) -> None:
                self.store.squeeze()

            async def squeezes_on_an_executor(self) -> None:
                await asyncio.get_running_loop().run_in_executor(None, self.store.squeeze)

            async def waits_for_an_event(self, event: asyncio.Event) -> None:
                await event.wait()

        async def sleeps(store: Store) -> None:
            time.sleep(0.1)

        async def reads_a_file(path: Path) -> str:
            return path.read_text()
        """,
    )
    found = {(f.function, f.call): f.chain for f in find_blocking(tmp_path, "pkg", ["pkg/server.py"])}
    assert found == {
        ("Service.squeezes_on_the_loop", ".compress"): (
            "Service.squeezes_on_the_loop",
            "Store.squeeze",
            "Store._retier",
        ),
        ("sleeps", "time.sleep"): ("sleeps",),
        ("reads_a_file", ".read_text"): ("reads_a_file",),
    }
