"""``CommandRunStatus`` from SandboxFusion's own ``sandbox/runners/types.py`` (kept from the
fetched tree by tests/upstream/suites.py; its models only, none of its runners)."""
from sandbox.runners.types import CommandRunStatus

__all__ = ["CommandRunStatus"]
