"""A unit that serves the HTTP API itself (``ingress: in_unit``): one deployment, no Ray hop per
streamed event.

With ``ingress: separate`` every streamed event crosses Ray twice (unit -> Ingress -> proxy),
and on a small CPU node the Ingress process and those hops take cores the model needs. Here the
Ingress's own code (``deployments.ingress``: validation, auth, limits, SSE, error objects) runs
in the unit's replica and reads the router's events as a local async generator. The deployment
keeps the unit's name (SpecRouter), so ``serve_config.yaml``'s ``user_config``, health checks,
autoscaling statistics and ``info`` reach it as before.

Admission: the proxy hands a replica up to its ``max_ongoing_requests`` (API calls included); the
unit itself takes ``max_concurrent_requests`` + ``UNIT_MAX_QUEUED`` generations at once (running
or waiting in its step loop, as a separate unit's queue would hold them) and refuses the next
with 503 + Retry-After, the Ingress's error object.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from ray import serve
from ray.serve.exceptions import BackPressureError

from deployments.config import RETRY_AFTER_S, UNIT_MAX_QUEUED, UnitArgs
from deployments.ingress import Ingress
from deployments.protocol import UnitEvent, UnitRequest
from deployments.router import SpecRouter


class LocalUnit:
    """The unit as the Ingress calls it (``unit.router.generate.remote(req)``, an async iterator
    of events), in this process. At most ``limit`` requests generate at once; the next one's
    first event raises ``BackPressureError`` (503 + Retry-After), as a full unit's Serve queue does.

        >>> import asyncio
        >>> class Echo:
        ...     async def generate(self, req):
        ...         yield req
        >>> unit = LocalUnit(Echo(), limit=1)
        >>> asyncio.run(unit.generate.remote("hi").__anext__())
        'hi'
    """

    def __init__(self, router, limit: int):
        self.router, self.limit = router, limit
        self.held = 0  # requests whose events are being read (admitted, not yet finished or gone)
        self.generate = self  # ``router.generate.remote(req)``, as on a DeploymentHandle

    def options(self, **_) -> "LocalUnit":
        return self  # a local generator streams already

    def remote(self, req: UnitRequest) -> AsyncIterator[UnitEvent]:
        return self._events(req)

    async def _events(self, req: UnitRequest) -> AsyncIterator[UnitEvent]:
        if self.held >= self.limit:
            raise BackPressureError(num_queued_requests=self.held, max_queued_requests=self.limit,
                                    retry_after_s=RETRY_AFTER_S)
        self.held += 1
        events = self.router.generate(req)
        try:
            async for event in events:
                yield event
        finally:  # finished, failed, cancelled (the client left) or no longer read (an Error event)
            self.held -= 1
            await events.aclose()  # the router's own cleanup (its request cancelled in the loop) now


@serve.deployment(name="SpecRouter")
class UnitIngress(Ingress.func_or_class):
    """The Ingress with its one unit in the same replica (the deployment ``SpecRouter``)."""

    async def __init__(self, unit: dict, keys: list[str] | None = None, request_limits: dict | None = None):
        self.unit = SpecRouter.func_or_class(unit)
        args = UnitArgs.model_validate(unit)
        self.local = LocalUnit(self.unit, args.max_concurrent_requests + UNIT_MAX_QUEUED)
        await super().__init__([{"router": self.local, "names": list(args.models.names)}], keys, request_limits)

    # What Serve and operators ask of a unit, answered by the router in this replica.
    def reconfigure(self, user_config: dict) -> None:
        self.unit.reconfigure(user_config)

    def check_health(self) -> None:
        self.unit.check_health()

    def record_autoscaling_stats(self) -> dict:
        return self.unit.record_autoscaling_stats()

    def info(self) -> dict:
        return {**self.unit.info(), "ingress": "in_unit", "admitted": self.local.held}
