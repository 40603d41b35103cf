"""``GET /v1/health``: no auth; the nodes the api places on."""
from fastapi import APIRouter
from pydantic import BaseModel

from rollbox.api.deps import Api

router = APIRouter(tags=["meta"])


class Health(BaseModel):
    status: str
    nodes: list[str]


@router.get("/v1/health", response_model=Health)
async def health(api: Api) -> Health:
    return Health(status="ok", nodes=sorted(api.placement.edges))
