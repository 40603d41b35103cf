"""``GET /v1/health``: no auth; the nodes the api places on. ``GET /metrics``: this process's
Prometheus metrics (rollbox.metrics; in the embedded node the edge's too), for an admin key
only (Prometheus' ``authorization`` with the key as a bearer token)."""
from fastapi import APIRouter, Response
from pydantic import BaseModel

from rollbox import metrics
from rollbox.api.deps import AdminWho, Api

router = APIRouter(tags=["meta"])


class Health(BaseModel):
    status: str
    nodes: list[str]


@router.get("/v1/health", response_model=Health)
async def health(api: Api) -> Health:
    return Health(status="ok", nodes=sorted(api.placement.edges))


@router.get("/metrics", response_class=Response)
async def prometheus_metrics(_: AdminWho) -> Response:
    return Response(metrics.process_metrics().exposition(), media_type=metrics.CONTENT_TYPE)
