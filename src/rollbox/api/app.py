"""The HTTP API (FastAPI): the only path from a trainer to its sandboxes.

:func:`create_app` assembles one app: the body caps (``api.bodies``), the error mapping
(``api.errors``), the routers of ``api.routes`` and the front doors it is given
(``api.frontdoors``), over one :class:`ApiContext` (``app.state.api``); every request gets
a request id (``rollbox.trace``: the client's ``X-Request-Id`` or a new one), repeated in
its answer's header and in every error body. Stateless apart from
the context's owner cache: sandbox ids route through :class:`Placement`, the audit trail is
the edges' own (``EdgeAPI.events``/``record_event``), principals and projects come from an :class:`IamStore`, quotas are held
in a :class:`QuotaLedger` (``rollbox.iam``: SQLite or PostgreSQL, the same for the api).
"""
import contextlib
from collections.abc import AsyncIterator, Sequence

from fastapi import FastAPI

from rollbox.api import dashboard, errors, frontdoors, hot, liveview, ports
from rollbox.api.bodies import BodyLimitMiddleware
from rollbox.api.context import ApiContext
from rollbox.api.observe import ApiMetricsMiddleware
from rollbox.api.sessions import Sessions
from rollbox.api.frontdoors import FrontDoor
from rollbox.api.routes import ROUTERS, exec as exec_routes, fncall, sandboxes
from rollbox.trace import RequestIdMiddleware
from rollbox.config import Settings
from rollbox.iam import IamStore, QuotaLedger
from rollbox.jobs import LeaseStore
from rollbox.placement import Placement
from rollbox.watcher import Watcher


def create_app(placement: Placement, keys: IamStore, *,
               leases: LeaseStore | None = None,
               ledger: QuotaLedger | None = None,
               front_doors: Sequence[FrontDoor] = (),
               watcher: Watcher | None = None,
               port_config: ports.PortConfig | None = None,
               view_config: liveview.ViewConfig | None = None) -> FastAPI:
    """The api keeps no audit trail of its own: each edge keeps its sandboxes' (read and added
    to through ``EdgeAPI.events``/``record_event``). ``leases``: the trainer-job lease
    store the edges sweep (None: no jobs on this server; see rollbox.api.routes.jobs).
    ``keys``: projects, keys and their limits; ``ledger``: the cluster-wide quota ledger the
    create path reserves in (None: only the edges' per-node admission enforces limits).
    ``front_doors``: mounted after the core routes, in order; the node's list comes
    from its composition root (``rollbox.embedded``); none: the core ``/v1`` api only.
    ``watcher``: the nodes' health (rollbox.watcher; its owner starts and stops it): a dead
    node's sandboxes answer sandbox_dead (reason node_lost), ``/v1/cluster/status``.
    ``port_config``: the exposed ports' domain and token key (rollbox.api.ports; None: the
    path form only, tokens under a per-process key).
    ``view_config``: the live view's lifetimes and noVNC's files (rollbox.api.liveview; None:
    the settings' defaults, the tokens under the port tokens' key).
    A placement whose view is a watcher nobody runs yet (``rollbox.watcher.placement_over``)
    has it run by this app, from its start-up to its shutdown."""
    api = ApiContext(placement, keys, leases, ledger=ledger, watcher=watcher)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            view = placement.view
            if isinstance(view, Watcher) and not view.running:
                await stack.enter_async_context(view)  # nobody else runs it: this app does
            stack.push_async_callback(app.state.port_pool.close)  # kept-alive port connections
            async with front_door_lifetime, fncall.pools(app, api):
                yield

    app = FastAPI(
        title="rollbox",
        version="0.1.0",
        description="Sandboxes for RL training of LLM agents.",
        lifespan=lifespan,
        # The routers' routes as the app's own, not include_router: FastAPI keeps an included
        # router as one route that every request is matched through (+20-70 us per request
        # measured here); these routers have no prefix, dependencies or options to apply.
        routes=[route for router in (*ROUTERS, dashboard.router) for route in router.routes],
    )
    # create, exec and delete: served without FastAPI's dependency solving (api.hot)
    hot.install(app.router.routes, {**sandboxes.LEAN, **exec_routes.LEAN})
    app.add_middleware(BodyLimitMiddleware)
    port_config = port_config or ports.PortConfig.ephemeral()
    ports.install(app, api, port_config)
    app.state.dashboard_sessions = Sessions(port_config.secret)  # its own key, derived
    liveview.install(app, api, view_config or liveview.ViewConfig.from_settings(
        Settings(), port_config.secret))
    app.add_middleware(ApiMetricsMiddleware)
    app.state.api = api
    errors.install(app)
    # entered by lifespan, which runs later; a front door may add a middleware of its own
    # (SWE-ReX's key check before routing), so the request id's is added after them
    front_door_lifetime = frontdoors.mount_all(app, api, front_doors)
    app.add_middleware(RequestIdMiddleware)  # outermost: every answer carries its request id
    return app


__all__ = ["create_app"]
