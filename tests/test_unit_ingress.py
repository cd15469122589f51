"""``ingress: in_unit``'s admission (``deployments.unit_ingress.LocalUnit``), without Ray: the
unit takes ``limit`` generations at once, refuses the next as a full unit's queue does (503 +
Retry-After through the Ingress), and a request that ends, fails or is abandoned frees its place."""

import asyncio

import pytest
from ray.serve.exceptions import BackPressureError

from deployments.config import RETRY_AFTER_S
from deployments.unit_ingress import LocalUnit


class Gate:
    """A router whose requests each yield one event, then wait for ``release``."""

    def __init__(self):
        self.release = asyncio.Event()
        self.closed = 0

    async def generate(self, req):
        try:
            yield f"start {req}"
            await self.release.wait()
            yield f"end {req}"
        finally:
            self.closed += 1


def test_the_unit_refuses_past_its_limit_and_each_way_out_frees_a_place():
    async def scenario():
        router = Gate()
        unit = LocalUnit(router, limit=2)
        assert unit.options(stream=True) is unit  # the Ingress asks a handle for streaming
        a, b = unit.generate.remote("a"), unit.generate.remote("b")
        assert await a.__anext__() == "start a" and await b.__anext__() == "start b"
        assert unit.held == 2
        refused = unit.generate.remote("c")
        with pytest.raises(BackPressureError) as exc:
            await refused.__anext__()
        assert exc.value.status_code == 503 and exc.value.retry_after_s == RETRY_AFTER_S
        assert unit.held == 2 and router.closed == 0  # the refused one never reached the router

        # A client that goes away: its reading task is cancelled mid-stream.
        async def read(events):
            return [e async for e in events]
        task = asyncio.create_task(read(a))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert unit.held == 1 and router.closed == 1
        # An answer the Ingress stops reading early (an Error event): closed, its place freed.
        await b.aclose()
        assert unit.held == 0 and router.closed == 2
        # Finished requests free theirs; the unit admits again.
        c, d = unit.generate.remote("c"), unit.generate.remote("d")
        assert await c.__anext__() == "start c" and await d.__anext__() == "start d"
        router.release.set()
        assert [e async for e in c] == ["end c"] and [e async for e in d] == ["end d"]
        assert unit.held == 0 and router.closed == 4

    asyncio.run(scenario())


def test_a_router_that_fails_frees_its_place():
    class Broken:
        async def generate(self, req):
            raise RuntimeError("the step loop died")
            yield  # an async generator

    async def scenario():
        unit = LocalUnit(Broken(), limit=1)
        for _ in range(3):  # never leaks: the same single place serves each attempt
            with pytest.raises(RuntimeError):
                await unit.generate.remote("x").__anext__()
            assert unit.held == 0

    asyncio.run(scenario())
