"""The api's own routes, one router per resource; ``create_app`` includes :data:`ROUTERS` in
this order. Each module owns its routes only; what they share is in ``api.deps`` (caller, edge
of a sandbox, the app's context), ``api.bodies`` and ``api.streams``."""
from fastapi import APIRouter

from rollbox.api.routes import (
    computer,
    cluster,
    events,
    exec,
    files,
    fncall,
    images,
    jobs,
    keys,
    meta,
    ports,
    projects,
    sandboxes,
)

ROUTERS: tuple[APIRouter, ...] = (
    meta.router,  # /v1/health
    sandboxes.router,  # /v1/sandboxes: lifecycle, TTL, pause, network, grade, snapshot
    exec.router,  # /v1/sandboxes/{id}/exec
    files.router,  # /v1/sandboxes/{id}/files, /tar
    projects.router,  # /v1/projects/{project}/quota
    events.router,  # /v1/sandboxes/{id}/events
    images.router,  # /v1/images: uploads, list, delete, layer storage, lazy-loading stats
    fncall.router,  # /v1/fncall: warm-pool stateless calls
    jobs.router,  # /v1/jobs: trainer-job leases
    keys.router,  # /v1/keys: list, revoke API keys (admin keys only)
    cluster.router,  # /v1/cluster/status: the watcher's view of the nodes
    ports.router,  # /v1/sandboxes/{id}/port-tokens (the proxy is api.ports' middleware)
    computer.router,  # /v1/sandboxes/{id}/screenshot, /display, /computer ("vm" sandboxes)
)

__all__ = ["ROUTERS"]
