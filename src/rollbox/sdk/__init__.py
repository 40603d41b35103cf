"""Python SDK: ``AsyncClient``/``AsyncSandbox`` (the one implementation) and the blocking
``Client``/``Sandbox`` face that runs it on a private event-loop thread.

Requests travel through a transport (``_transport``, httpx's seam): ``AiohttpTransport``, HTTP
to a server (the default: about a sixth of httpx's client CPU per request), or
``ASGITransport``, an api app called in-process (tests of the SDK: no server, no socket).

Talks only HTTP (or ASGI) to the api; never imports server-side packages beyond shared
models/errors (an ASGI transport is given the app, it imports nothing of the api). Its
defaults come from its user's environment (``ROLLBOX_URL``, ``ROLLBOX_API_KEY``: ``_env``),
not from the node's settings.
"""
from rollbox.errors import CommandFailed
from rollbox.sdk._aiohttp import AiohttpTransport
from rollbox.sdk._asgi import ASGITransport, Lifespan
from rollbox.sdk._async import (
    AsyncClient, AsyncFiles, AsyncImages, AsyncJob, AsyncProcess, AsyncSandbox,
    OutputChunk,
)
from rollbox.sdk._env import DEFAULT_URL, default_api_key, default_url
from rollbox.sdk._sync import Client, Files, Images, Job, Process, Sandbox
from rollbox.sdk._transport import AsyncTransport, BlockingTransport, Request, Response

__all__ = [
    "DEFAULT_URL", "AsyncClient", "AsyncFiles", "AsyncImages", "AsyncJob", "AsyncProcess",
    "AsyncSandbox", "CommandFailed", "OutputChunk", "Client", "Files", "Images", "Job",
    "Process", "Sandbox", "AsyncTransport", "BlockingTransport", "Request", "Response",
    "AiohttpTransport", "ASGITransport", "Lifespan", "default_api_key", "default_url",
]
