"""Browser workloads: the ``browser`` image (Debian's headless chromium + chromium-driver +
the MiniWoB++ HTML tasks of PyPI's ``miniwob``), the in-sandbox driver that serves a task and
acts on it through input events only, and the demo episode graded by replay in a fresh sandbox.

Owns: ``image`` (building ``browser:1`` with the project's image builder), ``driver`` (runs
INSIDE a sandbox, stdlib only, shipped in the image's tools layer), ``episode`` (the host-side
scripted agent, cheater and grader of ``rollbox demo --task browser``). Must not touch: the
edge, backends or the api; it uses them only through the SDK and the image builder.
"""
