"""The in-sandbox agent's protocol and host-side channel, shared by every backend.

Owns the wire format (`protocol`) and the host end of the channel (`channel`): sessions,
output retention, replay; and the platform shell the agent execs for command strings
(`platform_shell`). Must not touch a backend's internals (runc, QEMU, cgroups on the
host), the edge, the API or the journal: a backend hands it a connected transport.
"""
