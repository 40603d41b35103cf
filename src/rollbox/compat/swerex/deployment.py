"""A SWE-ReX deployment backed by a rollbox sandbox (client side; needs ``swe-rex``).

    deployment = RollboxDeployment(image="python:3.11", url=url, api_key=key)
    await deployment.start()          # creates the sandbox; deployment.runtime is ready
    await deployment.runtime.run_in_session(...)
    await deployment.stop()           # closes the sessions and deletes the sandbox
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from swerex.deployment.abstract import AbstractDeployment
from swerex.deployment.hooks.abstract import CombinedDeploymentHook, DeploymentHook
from swerex.exceptions import DeploymentNotStartedError
from swerex.runtime.abstract import IsAliveResponse
from swerex.runtime.remote import RemoteRuntime

from rollbox import errors
from rollbox.sdk import AsyncClient, default_api_key

log = logging.getLogger(__name__)


class RollboxDeployment(AbstractDeployment):
    """Creates (or attaches to, with ``sandbox_id``) a rollbox sandbox and exposes SWE-ReX's
    unmodified :class:`RemoteRuntime` pointed at it. ``url``/``api_key`` default to
    ``ROLLBOX_URL``/``ROLLBOX_API_KEY``; the other keywords are those of
    ``rollbox.AsyncClient.create``."""

    def __init__(self, *, image: str = "python:3.11", url: str | None = None,
                 api_key: str | None = None, sandbox_id: str | None = None,
                 layers: Iterable[str] = (), cpus: float | None = None,
                 memory_mib: int | None = None, disk_mib: int | None = None,
                 ttl_s: float | None = None, labels: Mapping[str, str] | None = None,
                 env: Mapping[str, str] | None = None, startup_timeout: float = 60.0,
                 runtime_timeout: float = 10.0, logger: logging.Logger | None = None) -> None:
        self.logger = logger or log
        self.image = image
        self._client = AsyncClient(url, api_key)
        self._api_key = api_key or default_api_key() or ""
        self._create_kw: dict[str, Any] = {
            "layers": list(layers), "cpus": cpus, "memory_mib": memory_mib,
            "disk_mib": disk_mib, "ttl_s": ttl_s, "labels": dict(labels or {}),
            "env": dict(env or {})}
        self.sandbox_id = sandbox_id
        self._owns_sandbox = sandbox_id is None
        self._startup_timeout = startup_timeout
        self._runtime_timeout = runtime_timeout
        self._runtime: RemoteRuntime | None = None
        self._hooks = CombinedDeploymentHook()

    @property
    def url(self) -> str:
        return self._client.base_url

    def add_hook(self, hook: DeploymentHook) -> None:
        self._hooks.add_hook(hook)

    @property
    def runtime(self) -> RemoteRuntime:
        if self._runtime is None:
            raise DeploymentNotStartedError()
        return self._runtime

    async def is_alive(self, *, timeout: float | None = None) -> IsAliveResponse:
        return await self.runtime.is_alive(timeout=timeout)

    async def start(self) -> None:
        from rollbox.compat.swerex import runtime_url

        if self.sandbox_id is None:
            self._hooks.on_custom_step(f"Creating rollbox sandbox ({self.image})")
            sandbox = await self._client.create(self.image, **self._create_kw)
            self.sandbox_id = sandbox.id
        self._runtime = RemoteRuntime(host=runtime_url(self.url, self.sandbox_id),
                                      auth_token=self._api_key, timeout=self._runtime_timeout,
                                      logger=self.logger)
        await self._runtime.wait_until_alive(timeout=self._startup_timeout)

    async def stop(self) -> None:
        """Close the runtime's sessions and delete the sandbox if this deployment made it."""
        if self._runtime is not None:
            try:
                await self._runtime.close()
            except Exception as exc:  # noqa: BLE001 - the sandbox may already be gone
                self.logger.debug("closing the runtime failed: %r", exc)
            self._runtime = None
        if self._owns_sandbox and self.sandbox_id is not None:
            try:
                await (await self._client.get(self.sandbox_id)).delete()
            except (errors.NotFound, errors.SandboxDead):
                pass
            self.sandbox_id = None
        await self._client.close()

    def __del__(self) -> None:
        # AbstractDeployment.__del__ schedules stop() on whatever loop is current; a rollbox
        # sandbox has a TTL, so a forgotten deployment is reclaimed without that.
        pass
