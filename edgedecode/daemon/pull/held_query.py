"""Asking a prefill server, before a pull is planned, how much of the prompt its prefix cache holds.

The planner prices a pull with the server's time for the tokens it will compute: those its prefix cache does not
hold. What a daemon learned from its own answers (``server_prefixes``) misses what *other* clients left there — a
document or system prompt shared by a fleet of boxes, which one box asks about for the first time. So, before
planning a long prompt, the daemon asks (``POST /v1/prefill/held``: the prompt's block-chain hashes, never its
tokens) and plans with the answer.

The question costs one round trip, so it is asked only where the answer can move the plan: the planner plans (a
pinned budget pulls whatever the server holds), the link is known (a probe pulls at the default budget either way),
even a server that computes nothing could beat computing here (a link too slow for any pull is asked nothing), and
at least ``MIN_UNKNOWN_BLOCKS`` complete blocks of the prompt are not already believed held, whose server time (at
the learned time per token) is more than the wait for the answer: ``WAIT_RTTS`` learned round trips. An endpoint
that does not know the route (an older server: 404 or 405), or let ``MAX_SILENT`` questions in a row go unanswered
in time, is not asked again; any other failure leaves the plan to what the daemon believed.
"""

from __future__ import annotations

import logging

import aiohttp
import numpy as np

from edgedecode.daemon.pull.link import LinkEstimate
from edgedecode.daemon.pull.segment import PullSettings
from edgedecode.kv.prefix import DEFAULT_BLOCK_TOKENS, HELD_PATH, block_chain, chain_to_hex

logger = logging.getLogger(__name__)

MIN_UNKNOWN_BLOCKS = 4  # complete 64-token blocks not believed held before the question is worth a round trip
WAIT_RTTS = 4.0  # the answer is waited on for this many learned round trips (at least MIN_WAIT_S)
MIN_WAIT_S = 0.05
MAX_SILENT = 3  # an endpoint that let this many questions in a row go unanswered in time is not asked again


def wait_s(rtt_s: float) -> float:
    """How long an answer is waited on over a link whose round trip is ``rtt_s``."""
    return max(WAIT_RTTS * rtt_s, MIN_WAIT_S)


class HeldQuery:
    """Asks each endpoint what its prefix cache holds of a prompt (see the module docstring)."""

    def __init__(self, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> None:
        self.block_tokens = block_tokens
        self._unsupported: set[str] = set()  # endpoints that do not answer (404 or 405, or too often not in time)
        self._silent: dict[str, int] = {}  # endpoint -> questions in a row it let go unanswered in time

    def worth_asking(self, url: str, prompt_tokens: int, believed_held: int, link: LinkEstimate) -> bool:
        """Whether ``url`` may be asked about a prompt of ``prompt_tokens`` tokens whose first ``believed_held``
        the daemon already believes held: enough complete blocks unknown, the endpoint answers such questions, and
        the server time an answer could save (the unknown blocks' at the learned time per token) exceeds the wait
        for it (whether the answer can move the plan otherwise is the planner's: ``KVPlanner.plans``,
        ``pull_could_win``)."""
        unknown_tokens = (prompt_tokens // self.block_tokens - believed_held // self.block_tokens) * self.block_tokens
        if unknown_tokens < MIN_UNKNOWN_BLOCKS * self.block_tokens or url.rstrip("/") in self._unsupported:
            return False
        if link.rtt_s is None or link.server_s_per_token is None:
            return False
        return link.server_s_per_token * unknown_tokens > wait_s(link.rtt_s)

    async def ask(
        self, http: aiohttp.ClientSession, settings: PullSettings, prompt_ids: np.ndarray, rtt_s: float
    ) -> int | None:
        """The leading tokens of ``prompt_ids`` that the server at ``settings.url`` says it holds; None when it did
        not answer usefully within ``WAIT_RTTS`` round trips (the reason logged)."""
        url = settings.url.rstrip("/")
        headers = {"Authorization": f"Bearer {settings.token}"} if settings.token else {}
        body = {"blocks": chain_to_hex(block_chain(prompt_ids, self.block_tokens))}
        waited = wait_s(rtt_s)
        try:
            async with http.post(
                url + HELD_PATH,
                json=body,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=waited),
                allow_redirects=False,
            ) as response:
                if response.status in (404, 405):
                    self._unsupported.add(url)
                    logger.info(
                        "%s does not answer held queries (HTTP %d): plans price what it was seen to hold",
                        url,
                        response.status,
                    )
                    return None
                if response.status != 200:
                    logger.info(
                        "held query to %s answered HTTP %d: planned with what was believed", url, response.status
                    )
                    return None
                answer = await response.json()
        except TimeoutError:
            self._silent[url] = silent = self._silent.get(url, 0) + 1
            if silent >= MAX_SILENT:
                self._unsupported.add(url)
            logger.info(
                "held query to %s got no answer within %.0f ms (%d in a row%s): planned with what was believed",
                url,
                1e3 * waited,
                silent,
                "; not asked again" if silent >= MAX_SILENT else "",
            )
            return None
        except (aiohttp.ClientError, ValueError) as exc:
            logger.info("held query to %s failed (%s): planned with what was believed", url, exc)
            return None
        self._silent.pop(url, None)
        return self._held(url, answer, len(prompt_ids))

    def _held(self, url: str, answer: object, prompt_tokens: int) -> int | None:
        """The answer's ``held_tokens`` if it is one this daemon can use."""
        if not isinstance(answer, dict):
            logger.info("held query to %s answered %r: not an answer", url, answer)
            return None
        held, block_tokens = answer.get("held_tokens"), answer.get("block_tokens")
        if block_tokens != self.block_tokens:
            self._unsupported.add(url)
            logger.info(
                "%s counts its prefix cache in blocks of %r tokens, not %d: not asked again",
                url,
                block_tokens,
                self.block_tokens,
            )
            return None
        if not isinstance(held, int) or isinstance(held, bool) or not 0 <= held <= prompt_tokens:
            logger.info("held query to %s answered held_tokens %r for a %d-token prompt", url, held, prompt_tokens)
            return None
        return held
