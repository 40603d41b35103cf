"""Python SDK: ``AsyncClient``/``AsyncSandbox`` (the one implementation, on aiohttp: about a
sixth of httpx's client CPU per request) and the blocking ``Client``/``Sandbox`` face that runs
it on a private event-loop thread.

Talks only HTTP to the api; never imports server-side packages beyond shared models/errors.
"""
from rollbox.sdk._async import (
    DEFAULT_URL, AsyncClient, AsyncFiles, AsyncImages, AsyncJob, AsyncProcess, AsyncSandbox,
    CommandFailed, OutputChunk,
)
from rollbox.sdk._sync import Client, Files, Images, Job, Process, Sandbox

__all__ = [
    "DEFAULT_URL", "AsyncClient", "AsyncFiles", "AsyncImages", "AsyncJob", "AsyncProcess",
    "AsyncSandbox", "CommandFailed", "OutputChunk", "Client", "Files", "Images", "Job",
    "Process", "Sandbox",
]
