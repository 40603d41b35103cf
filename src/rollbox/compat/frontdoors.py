"""The node's front doors, in mounting order: what ``rollbox serve`` (``rollbox.embedded``)
passes to ``create_app(..., front_doors=FRONT_DOORS)``. Listed here, above the api, because
they import it (the api only defines :class:`~rollbox.api.frontdoors.FrontDoor`). Owns only
this list; each front door owns its routes."""
from __future__ import annotations

from rollbox.api import mirror
from rollbox.api.frontdoors import FrontDoor
from rollbox.compat import e2b, sandboxfusion, swerex

FRONT_DOORS: tuple[FrontDoor, ...] = (
    e2b.mount,  # E2B control plane under /e2b, envd under /e2b/envd
    mirror.mount,  # no routes: runs the PyPI mirror on its own port when enabled
    swerex.mount,  # SWE-ReX remote runtime per sandbox under /swerex/{sandbox_id}
    sandboxfusion.mount,  # SandboxFusion POST /run_code on the fncall pools
)

__all__ = ["FRONT_DOORS"]
