"""Peers' protocols served by rollbox (E2B, SWE-ReX, SandboxFusion): each maps its wire format
onto the edge; none touches the core ``/v1`` routes. ``frontdoors.FRONT_DOORS`` lists them for a
node's app."""
