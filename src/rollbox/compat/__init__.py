"""Peers' protocols served by rollbox (E2B, SWE-ReX): each maps its wire format onto the edge; none touches the core ``/v1`` routes."""
