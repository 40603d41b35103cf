"""Network policy of sandboxes: named permissions and custom rules resolved to per-sandbox
allow-lists (IP, port, protocol) enforced by cgroup-BPF, a DNS gate on the host side of each
sandbox's veth link, and live policy changes.

Owns: src/rollbox/netpolicy/ (except mirror.py, the package mirror, owned elsewhere). Must not
touch the sandbox's own files beyond /etc/resolv.conf, nor host network state other than the
rollbox-named links (``rbx*``) and the ``rollbox`` nftables table.
"""
