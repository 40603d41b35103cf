"""rollbox's stand-in for SandboxFusion's server package ``sandbox`` in its runner tests
(tests/upstream/suites.py puts it first on their path): the tests' imports resolve to the
pinned ``sandbox-fusion`` client's models, and ``sandbox.server.server.app`` forwards each
request to rollbox's SandboxFusion front door (``{ROLLBOX_URL}/sandboxfusion/{key}``) instead
of running SandboxFusion's server in process. Owns only this mapping; runs no code itself."""
