"""The example graph's nodes: deterministic string steps, A -> B, A -> C, (B, C) -> D.

B and C each take STEP_S seconds, so when they run concurrently the request takes ~STEP_S, not 2 x STEP_S.
B's forward is a plain function (it runs in a worker thread); C's is a coroutine.
"""

import asyncio
import time

STEP_S = 1.0


class Normalize:
    """A: a node without depends gets the request fields (prompt, times) as keyword arguments."""

    def forward(self, prompt: str, times: int) -> str:
        return " ".join([" ".join(prompt.split()).lower()] * times)


class Shout:
    """B: gets A's output as its one positional argument."""

    def forward(self, text: str) -> str:
        time.sleep(STEP_S)
        return text.upper()


class Reverse:
    """C: also depends on A, so it starts together with B."""

    async def forward(self, text: str) -> str:
        await asyncio.sleep(STEP_S)
        return text[::-1]


class Join:
    """D, the sink: gets B's and C's outputs, in the order of its `depends`; its output is the response."""

    def forward(self, shouted: str, reversed_text: str) -> dict:
        return {"shouted": shouted, "reversed": reversed_text}
