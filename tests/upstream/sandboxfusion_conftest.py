"""rollbox's stand-in for SandboxFusion's ``sandbox/tests/conftest.py`` (which configured the
in-process server's logging): nothing to set up, the server is rollbox's."""
