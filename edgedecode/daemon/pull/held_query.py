"""Asking a prefill server, before a pull is planned, how much of the prompt its prefix cache holds.

The planner prices a pull with the server's time for the tokens it will compute: those its prefix cache does not
hold. What a daemon learned from its own answers (``server_prefixes``) misses what *other* clients left there — a
document or system prompt shared by a fleet of boxes, which one box asks about for the first time. So, before
planning a long prompt, the daemon asks (``POST /v1/prefill/held``: the prompt's block-chain hashes, never its
tokens) and plans with the answer.

The question costs one round trip, so it is asked only where the answer can move the plan: the planner plans (a
pinned budget pulls whatever the server holds), the link is known (a probe pulls at the default budget either way),
even a server that computes nothing could beat computing here (a link too slow for any pull is asked nothing), and
at least ``MIN_UNKNOWN_BLOCKS`` complete blocks of the prompt are not already believed held. The answer is waited
on for a few learned round trips at most; an endpoint that does not know the route (an older server: 404 or 405)
is not asked again, and any other failure leaves the plan to what the daemon believed.
"""

from __future__ import annotations

import logging

import aiohttp
import numpy as np

from edgedecode.daemon.pull.segment import PullSettings
from edgedecode.kv.prefix import DEFAULT_BLOCK_TOKENS, block_chain, chain_to_hex

logger = logging.getLogger(__name__)

HELD_PATH = "/v1/prefill/held"
MIN_UNKNOWN_BLOCKS = 4  # complete 64-token blocks not believed held before the question is worth a round trip
WAIT_RTTS = 4.0  # the answer is waited on for this many learned round trips, within the bounds below
MIN_WAIT_S, MAX_WAIT_S = 0.05, 0.5


class HeldQuery:
    """Asks each endpoint what its prefix cache holds of a prompt (see the module docstring)."""

    def __init__(self, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> None:
        self.block_tokens = block_tokens
        self._unsupported: set[str] = set()  # endpoints that answered the route with 404 or 405

    def worth_asking(self, url: str, prompt_tokens: int, believed_held: int) -> bool:
        """Whether ``url`` may be asked about a prompt of ``prompt_tokens`` tokens whose first ``believed_held``
        the daemon already believes held: enough complete blocks unknown, and the endpoint knows the question
        (whether the answer can move the plan is the planner's: ``KVPlanner.plans``, ``pull_could_win``)."""
        unknown_blocks = prompt_tokens // self.block_tokens - believed_held // self.block_tokens
        return unknown_blocks >= MIN_UNKNOWN_BLOCKS and url.rstrip("/") not in self._unsupported

    async def ask(
        self, http: aiohttp.ClientSession, settings: PullSettings, prompt_ids: np.ndarray, rtt_s: float
    ) -> int | None:
        """The leading tokens of ``prompt_ids`` that the server at ``settings.url`` says it holds; None when it did
        not answer usefully within ``WAIT_RTTS`` round trips (the reason logged)."""
        url = settings.url.rstrip("/")
        headers = {"Authorization": f"Bearer {settings.token}"} if settings.token else {}
        body = {"blocks": chain_to_hex(block_chain(prompt_ids, self.block_tokens))}
        wait_s = min(max(WAIT_RTTS * rtt_s, MIN_WAIT_S), MAX_WAIT_S)
        try:
            async with http.post(
                url + HELD_PATH,
                json=body,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=wait_s),
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
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            logger.info(
                "held query to %s got no answer within %.0f ms (%s): planned with what was believed",
                url,
                1e3 * wait_s,
                exc,
            )
            return None
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
