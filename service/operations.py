"""The operations routes: GET /v1/models (what is loaded), /livez, /readyz, /metrics (Prometheus)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from longdoc.service.core import Service, error_response
from longdoc.service.errors import Unavailable
from longdoc.service.validation import ErrorResponse, ModelsResponse

router = APIRouter()


@router.get("/v1/models", response_model=ModelsResponse, tags=["operations"])
async def models(request: Request):
    service: Service = request.app.state.service
    return {"models": [
        {"name": n, "task": m.info.task, "default": service.defaults.get(m.info.task) == n,
         "max_length": m.info.max_length, "block_size": m.info.block_size, "plan": m.info.plan,
         "dtype": m.info.dtype, "labels": list(m.info.labels) if m.info.labels else None, "devices": m.devices}
        for n, m in service.models.items()
    ]}


@router.get("/livez", tags=["operations"])
async def livez():
    return {"status": "ok"}


@router.get("/readyz", tags=["operations"], responses={503: {"model": ErrorResponse}})
async def readyz(request: Request):
    service: Service = request.app.state.service
    if service.is_ready():
        return {"status": "ready"}
    why = "shutting down" if service.draining else "models loading or a worker restarting"
    return error_response(Unavailable(f"not ready: {why}"))


@router.get("/metrics", tags=["operations"], response_class=Response)
async def metrics(request: Request):
    body, ctype = request.app.state.service.metrics.render()
    return Response(body, media_type=ctype)
