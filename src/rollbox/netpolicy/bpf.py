"""cgroup-BPF enforcement of a sandbox's allow-list, through bpf(2) by ctypes (no compiler).

One LPM-trie map per sandbox holds the allowed (protocol, port, IPv4 prefix) triples; six
hand-assembled programs read it:

* ``connect4`` / ``sendmsg4`` (cgroup/sock_addr): refuse a connect() or an unconnected UDP send
  to a destination not in the map with EPERM, so the caller sees a clear error at once;
* ``connect6`` / ``sendmsg6``: IPv6 only to ``::1`` (the sandbox's own loopback);
* ``egress`` / ``ingress`` (cgroup/skb): every IPv4 packet's remote address and port is
  checked against the same map, so removing an entry cuts connections opened earlier too.
  Traffic on ``lo`` (ifindex 1, the sandbox's own loopback) always passes.

Every refusal is also counted, per hook, in the sandbox's counter map (one array entry of
``len(COUNTERS)`` u64, atomic adds): the audit trail of denied connects, sends and dropped
packets (``CounterMap.read``). Not counted: non-IPv4 frames the packet filter drops (the
kernel's own IPv6 neighbour discovery would be noise; a sandbox's IPv6 attempts are counted
at connect6/sendmsg6).

Programs are attached with BPF_F_ALLOW_MULTI to the sandbox's cgroup-v2 directory; child
cgroups (the agent's per-command cgroups) inherit them. They are released with the cgroup,
and the maps with them. A policy change is a few map updates (no reload, no re-attach).
Programs are named ``rbx<hook number><tag>``, the maps ``rbx_<tag>`` and ``rbc_<tag>`` (tag: the
end of the sandbox id), so :func:`objects_of` finds anything of a deleted sandbox still loaded.
"""
from __future__ import annotations

import ctypes
import ipaddress
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
SYS_bpf = 321

# bpf(2) commands
MAP_CREATE, MAP_LOOKUP_ELEM, MAP_UPDATE_ELEM, MAP_DELETE_ELEM, MAP_GET_NEXT_KEY = 0, 1, 2, 3, 4
PROG_LOAD, PROG_ATTACH, PROG_DETACH = 5, 8, 9
PROG_GET_NEXT_ID, MAP_GET_NEXT_ID = 11, 12
PROG_GET_FD_BY_ID, MAP_GET_FD_BY_ID, OBJ_GET_INFO_BY_FD, PROG_QUERY = 13, 14, 15, 16

MAP_TYPE_ARRAY = 2
MAP_TYPE_LPM_TRIE = 11
F_NO_PREALLOC = 1
PROG_TYPE_CGROUP_SKB = 8
PROG_TYPE_CGROUP_SOCK_ADDR = 18
F_ALLOW_MULTI = 2

ATTACH_INGRESS = 0
ATTACH_EGRESS = 1
ATTACH_CONNECT4 = 10
ATTACH_CONNECT6 = 11
ATTACH_SENDMSG4 = 14
ATTACH_SENDMSG6 = 15

PROTO_TCP = 6
PROTO_UDP = 17
PROTOS = {"tcp": PROTO_TCP, "udp": PROTO_UDP}

# Key: u32 prefixlen, then data [proto u8][pad u8][port be16][ipv4 be32]; the prefix covers
# proto+pad+port (32 bits) plus the CIDR length, so a rule is one entry whatever its CIDR.
KEY_SIZE = 12
VALUE_SIZE = 4
MAX_ENTRIES = 4096
PROG_PREFIX = "rbx_"
COUNTER_PREFIX = "rbc_"
# Slots of the counter map's one value, in this order (u64 each).
COUNTERS = ("connect4", "sendmsg4", "connect6", "sendmsg6", "egress", "ingress")


def _bpf(cmd: int, attr: bytes) -> int:
    buf = ctypes.create_string_buffer(attr, max(len(attr), 128))
    ret = _syscall(SYS_bpf, ctypes.c_int(cmd), buf, ctypes.c_uint(max(len(attr), 128)))
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"bpf({cmd}): {os.strerror(err)}")
    return int(ret)


def _bpf_buf(cmd: int, buf: ctypes.Array) -> int:  # type: ignore[type-arg]
    ret = _syscall(SYS_bpf, ctypes.c_int(cmd), buf, ctypes.c_uint(len(buf)))
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"bpf({cmd}): {os.strerror(err)}")
    return int(ret)


# ---- a tiny eBPF assembler ------------------------------------------------------------------
R0, R1, R2, R3, R4, R5, R6, R7, R8, R9, R10 = range(11)
_W, _H, _B = 0x00, 0x08, 0x10


def _insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, (src << 4) | dst, off, imm)


def mov_imm(dst: int, imm: int) -> bytes:
    return _insn(0xB7, dst, imm=imm)  # ALU64 MOV K


def mov_reg(dst: int, src: int) -> bytes:
    return _insn(0xBF, dst, src)  # ALU64 MOV X


def add_imm(dst: int, imm: int) -> bytes:
    return _insn(0x07, dst, imm=imm)


def and_imm(dst: int, imm: int) -> bytes:
    return _insn(0x57, dst, imm=imm)


def lsh_imm(dst: int, imm: int) -> bytes:
    return _insn(0x67, dst, imm=imm)


def ldx(size: int, dst: int, src: int, off: int) -> bytes:
    return _insn(0x61 | size, dst, src, off)  # LDX MEM


def stx(size: int, dst: int, src: int, off: int) -> bytes:
    return _insn(0x63 | size, dst, src, off)  # STX MEM


def st_imm(size: int, dst: int, off: int, imm: int) -> bytes:
    return _insn(0x62 | size, dst, off=off, imm=imm)  # ST MEM


def call(helper: int) -> bytes:
    return _insn(0x85, imm=helper)


def exit_() -> bytes:
    return _insn(0x95)


def atomic_add64(dst: int, off: int, src: int) -> bytes:
    return _insn(0xDB, dst, src, off, 0)  # STX | DW | ATOMIC, imm BPF_ADD: *(u64 *)(dst+off) += src


def ld_map_fd(dst: int, fd: int) -> bytes:
    return _insn(0x18, dst, 1, 0, fd) + _insn(0, 0, 0, 0, 0)  # BPF_PSEUDO_MAP_FD


class _Prog:
    """Instructions with symbolic forward jumps (resolved by label at build time)."""

    def __init__(self) -> None:
        self.code: list[bytes] = []
        self.fixups: list[tuple[int, str]] = []
        self.labels: dict[str, int] = {}

    def emit(self, *insns: bytes) -> None:
        for i in insns:
            for k in range(0, len(i), 8):
                self.code.append(i[k:k + 8])

    def jmp_imm(self, op: int, reg: int, imm: int, label: str) -> None:
        """op: 0x10 JEQ, 0x50 JNE, 0x00 JA (reg/imm ignored)."""
        self.fixups.append((len(self.code), label))
        self.code.append(_insn(0x05 | op, reg, imm=imm))

    def label(self, name: str) -> None:
        self.labels[name] = len(self.code)

    def build(self) -> bytes:
        for idx, name in self.fixups:
            code, regs, _off, imm = struct.unpack("<BBhi", self.code[idx])
            self.code[idx] = struct.pack("<BBhi", code, regs, self.labels[name] - idx - 1, imm)
        return b"".join(self.code)


JEQ, JNE, JA = 0x10, 0x50, 0x00
HELPER_MAP_LOOKUP = 1
HELPER_SKB_LOAD_BYTES = 26


def _deny_counted(p: _Prog, counters_fd: int, hook: str) -> None:
    """Label "deny": add 1 to the hook's counter slot, then refuse."""
    p.label("deny")
    p.emit(st_imm(_W, R10, -48, 0), ld_map_fd(R1, counters_fd), mov_reg(R2, R10),
           add_imm(R2, -48), call(HELPER_MAP_LOOKUP))
    p.jmp_imm(JEQ, R0, 0, "refuse")
    p.emit(mov_imm(R1, 1), atomic_add64(R0, 8 * COUNTERS.index(hook), R1))
    p.label("refuse")
    p.emit(mov_imm(R0, 0), exit_())


def _lookup_tail(p: _Prog, map_fd: int, proto_reg: int, port_reg: int, ip_reg: int,
                 allow: int, counters_fd: int, hook: str) -> None:
    """Build the key at fp-16 from registers, look it up, return allow if found, else count
    the refusal and return 0."""
    p.emit(st_imm(_W, R10, -16, 64), st_imm(_W, R10, -12, 0),
           stx(_B, R10, proto_reg, -12), stx(_H, R10, port_reg, -10), stx(_W, R10, ip_reg, -8),
           *[ld_map_fd(R1, map_fd)], mov_reg(R2, R10), add_imm(R2, -16),
           call(HELPER_MAP_LOOKUP))
    p.jmp_imm(JEQ, R0, 0, "deny")
    p.emit(mov_imm(R0, allow), exit_())
    _deny_counted(p, counters_fd, hook)


def sock_addr4_program(map_fd: int, counters_fd: int, hook: str) -> bytes:
    """connect4/sendmsg4: allow 127/8 (own loopback) and mapped destinations."""
    p = _Prog()
    p.emit(mov_reg(R6, R1), ldx(_W, R7, R6, 4))          # r7 = user_ip4 (network order)
    p.emit(mov_reg(R3, R7), and_imm(R3, 0xFF))
    p.jmp_imm(JEQ, R3, 127, "allow")
    p.emit(ldx(_W, R8, R6, 24), ldx(_W, R9, R6, 36))     # r8 = user_port, r9 = protocol
    _lookup_tail(p, map_fd, R9, R8, R7, 1, counters_fd, hook)
    p.label("allow")
    p.emit(mov_imm(R0, 1), exit_())
    return p.build()


def sock_addr6_program(counters_fd: int, hook: str) -> bytes:
    """connect6/sendmsg6: only ::1."""
    p = _Prog()
    for off in (8, 12, 16):
        p.emit(ldx(_W, R2, R1, off))
        p.jmp_imm(JNE, R2, 0, "deny")
    p.emit(ldx(_W, R2, R1, 20))
    p.jmp_imm(JNE, R2, 0x01000000, "deny")
    p.emit(mov_imm(R0, 1), exit_())
    _deny_counted(p, counters_fd, hook)
    return p.build()


def skb_program(map_fd: int, egress: bool, counters_fd: int) -> bytes:
    """Packet filter: remote = destination on egress, source on ingress."""
    p = _Prog()
    p.emit(mov_reg(R6, R1), ldx(_W, R2, R6, 40))          # ifindex
    p.jmp_imm(JEQ, R2, 1, "allow")                        # the sandbox's own lo
    p.emit(ldx(_W, R2, R6, 16))                           # skb->protocol (be16)
    p.jmp_imm(JNE, R2, 0x0008, "drop")                    # IPv4 only (ETH_P_IP), uncounted
    # IPv4 header -> fp-40 .. fp-20
    p.emit(mov_reg(R1, R6), mov_imm(R2, 0), mov_reg(R3, R10), add_imm(R3, -40), mov_imm(R4, 20),
           call(HELPER_SKB_LOAD_BYTES))
    p.jmp_imm(JNE, R0, 0, "deny")
    p.emit(ldx(_H, R2, R10, -40 + 6), and_imm(R2, 0xFF1F))  # fragment offset (LE view)
    p.jmp_imm(JNE, R2, 0, "deny")                          # non-first fragments: no ports
    p.emit(ldx(_B, R9, R10, -40 + 9))                      # r9 = protocol
    p.jmp_imm(JEQ, R9, PROTO_TCP, "l4")
    p.jmp_imm(JNE, R9, PROTO_UDP, "deny")
    p.label("l4")
    p.emit(ldx(_W, R7, R10, -40 + (16 if egress else 12)))  # r7 = remote ip
    p.emit(ldx(_B, R2, R10, -40), and_imm(R2, 0x0F), lsh_imm(R2, 2))  # r2 = ihl*4
    p.emit(mov_reg(R1, R6), mov_reg(R3, R10), add_imm(R3, -44), mov_imm(R4, 4),
           call(HELPER_SKB_LOAD_BYTES))
    p.jmp_imm(JNE, R0, 0, "deny")
    p.emit(ldx(_H, R8, R10, -44 + (2 if egress else 0)))   # r8 = remote port (be16)
    # _lookup_tail defines "deny"; "allow" follows it.
    _lookup_tail(p, map_fd, R9, R8, R7, 1, counters_fd, "egress" if egress else "ingress")
    p.label("allow")
    p.emit(mov_imm(R0, 1), exit_())
    p.label("drop")
    p.emit(mov_imm(R0, 0), exit_())
    return p.build()


def load_program(prog_type: int, insns: bytes, name: str, attach_type: int = 0) -> int:
    license_ = ctypes.create_string_buffer(b"GPL")
    code = ctypes.create_string_buffer(insns, len(insns))
    log = ctypes.create_string_buffer(65536)
    attr = struct.pack("<IIQQIIQII16sII", prog_type, len(insns) // 8,
                       ctypes.addressof(code), ctypes.addressof(license_), 0, 0, 0, 0, 0,
                       name.encode()[:15], 0, attach_type)
    try:
        return _bpf(PROG_LOAD, attr)
    except OSError:
        attr = struct.pack("<IIQQIIQII16sII", prog_type, len(insns) // 8,
                           ctypes.addressof(code), ctypes.addressof(license_), 1, len(log),
                           ctypes.addressof(log), 0, 0, name.encode()[:15], 0, attach_type)
        try:
            return _bpf(PROG_LOAD, attr)
        except OSError as exc:
            raise OSError(exc.errno, f"BPF load of {name} failed: {exc}\n"
                          f"{log.value.decode(errors='replace')[-2000:]}") from None


def create_map(name: str, max_entries: int = MAX_ENTRIES) -> int:
    attr = struct.pack("<IIIIIII16s", MAP_TYPE_LPM_TRIE, KEY_SIZE, VALUE_SIZE, max_entries,
                       F_NO_PREALLOC, 0, 0, name.encode()[:15])
    return _bpf(MAP_CREATE, attr)


def create_counter_map(name: str) -> int:
    attr = struct.pack("<IIIIIII16s", MAP_TYPE_ARRAY, 4, 8 * len(COUNTERS), 1, 0, 0, 0,
                       name.encode()[:15])
    return _bpf(MAP_CREATE, attr)


class CounterMap:
    """The sandbox's refusal counters (one value: a u64 per hook of COUNTERS)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def read(self) -> dict[str, int]:
        kb = ctypes.create_string_buffer(struct.pack("<I", 0), 4)
        vb = ctypes.create_string_buffer(8 * len(COUNTERS))
        _bpf(MAP_LOOKUP_ELEM, struct.pack("<IIQQQ", self.fd, 0, ctypes.addressof(kb),
                                          ctypes.addressof(vb), 0))
        return dict(zip(COUNTERS, struct.unpack(f"<{len(COUNTERS)}Q", vb.raw), strict=True))

    @property
    def is_open(self) -> bool:
        return self.fd >= 0

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def attach(cgroup_fd: int, prog_fd: int, attach_type: int) -> None:
    _bpf(PROG_ATTACH, struct.pack("<IIIII", cgroup_fd, prog_fd, attach_type, F_ALLOW_MULTI, 0))


def query(cgroup_fd: int, attach_type: int) -> list[int]:
    """Ids of the programs attached directly to this cgroup for attach_type."""
    ids = (ctypes.c_uint32 * 64)()
    buf = ctypes.create_string_buffer(struct.pack("<IIIIQI", cgroup_fd, attach_type, 0, 0,
                                                  ctypes.addressof(ids), 64), 128)
    _bpf_buf(PROG_QUERY, buf)
    count = struct.unpack_from("<I", buf.raw, 24)[0]
    return list(ids[:count])


def _prog_info(prog_fd: int) -> tuple[str, list[int]]:
    """(name, map ids) of a loaded program."""
    map_ids = (ctypes.c_uint32 * 8)()
    info = bytearray(256)
    struct.pack_into("<I", info, 52, 8)
    struct.pack_into("<Q", info, 56, ctypes.addressof(map_ids))
    info_buf = ctypes.create_string_buffer(bytes(info), len(info))
    attr = struct.pack("<IIQ", prog_fd, len(info), ctypes.addressof(info_buf))
    _bpf(OBJ_GET_INFO_BY_FD, attr)
    nr = struct.unpack_from("<I", info_buf.raw, 52)[0]
    name = info_buf.raw[64:80].split(b"\0")[0].decode()
    return name, list(map_ids[:min(nr, 8)])


def key_bytes(proto: int, port: int, net: ipaddress.IPv4Network) -> bytes:
    return (struct.pack("<IBB", 32 + net.prefixlen, proto, 0) + struct.pack(">H", port)
            + net.network_address.packed)


def entry_of(key: bytes) -> Entry | None:
    """The Entry a map key stands for (None for a key this module never writes)."""
    if len(key) != KEY_SIZE:
        return None
    plen, proto, _pad = struct.unpack_from("<IBB", key)
    port = struct.unpack_from(">H", key, 6)[0]
    if not 32 <= plen <= 64:
        return None
    try:
        net = ipaddress.IPv4Network((bytes(key[8:12]), plen - 32))
    except ValueError:
        return None
    return Entry(proto, port, net)


@dataclass(frozen=True)
class Entry:
    """One allowed (protocol, port, IPv4 network)."""
    proto: int
    port: int
    net: ipaddress.IPv4Network

    def key(self) -> bytes:
        return key_bytes(self.proto, self.port, self.net)


class AllowMap:
    """The sandbox's allow-list map, updated in place."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def _elem(self, cmd: int, key: bytes, value: bytes | None, flags: int = 0) -> None:
        kb = ctypes.create_string_buffer(key, len(key))
        vb = ctypes.create_string_buffer(value or b"\0" * VALUE_SIZE, VALUE_SIZE)
        _bpf(cmd, struct.pack("<IIQQQ", self.fd, 0, ctypes.addressof(kb),
                              ctypes.addressof(vb) if value is not None else 0, flags))

    def add(self, entries: Iterable[Entry]) -> None:
        for e in entries:
            self._elem(MAP_UPDATE_ELEM, e.key(), struct.pack("<I", 1))

    def remove(self, entries: Iterable[Entry]) -> None:
        for e in entries:
            try:
                self._elem(MAP_DELETE_ELEM, e.key(), None)
            except FileNotFoundError:
                pass
            except OSError as exc:
                if exc.errno != 2:
                    raise

    def keys(self) -> list[bytes]:
        out: list[bytes] = []
        prev: bytes | None = None
        while True:
            nk = ctypes.create_string_buffer(KEY_SIZE)
            pk = ctypes.create_string_buffer(prev, KEY_SIZE) if prev is not None else None
            try:
                _bpf(MAP_GET_NEXT_KEY, struct.pack(
                    "<IIQQ", self.fd, 0, ctypes.addressof(pk) if pk is not None else 0,
                    ctypes.addressof(nk)))
            except OSError as exc:
                if exc.errno == 2:
                    return out
                raise
            prev = nk.raw
            out.append(prev)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


HOOKS: tuple[tuple[str, int], ...] = (
    ("connect4", ATTACH_CONNECT4), ("sendmsg4", ATTACH_SENDMSG4),
    ("connect6", ATTACH_CONNECT6), ("sendmsg6", ATTACH_SENDMSG6),
    ("egress", ATTACH_EGRESS), ("ingress", ATTACH_INGRESS),
)


def map_name(tag: str) -> str:
    return f"{PROG_PREFIX}{tag}"[:15]


def counter_map_name(tag: str) -> str:
    return f"{COUNTER_PREFIX}{tag}"[:15]


def prog_name(hook: str, tag: str) -> str:
    """``rbx<hook number><tag>``: a leaked program names its sandbox (15 characters max)."""
    return f"{PROG_PREFIX[:3]}{[h for h, _ in HOOKS].index(hook)}{tag}"[:15]


def _ids(next_cmd: int) -> list[int]:
    out: list[int] = []
    cur = 0
    while True:
        buf = ctypes.create_string_buffer(struct.pack("<III", cur, 0, 0), 128)
        try:
            _bpf_buf(next_cmd, buf)
        except OSError as exc:
            if exc.errno == 2:
                return out
            raise
        cur = struct.unpack_from("<I", buf.raw, 4)[0]
        out.append(cur)


def _map_name(map_fd: int) -> str:
    info = ctypes.create_string_buffer(128)
    _bpf(OBJ_GET_INFO_BY_FD, struct.pack("<IIQ", map_fd, 128, ctypes.addressof(info)))
    return info.raw[24:40].split(b"\0")[0].decode(errors="replace")


def objects_of(tag: str) -> list[str]:
    """Programs and maps of the sandbox with this tag still loaded anywhere on the host, by
    id and name (teardown checks: BPF_{PROG,MAP}_GET_NEXT_ID and their info)."""
    left: list[str] = []
    want_progs = {prog_name(h, tag) for h, _ in HOOKS}
    for cmd_next, cmd_fd, kind in ((PROG_GET_NEXT_ID, PROG_GET_FD_BY_ID, "prog"),
                                   (MAP_GET_NEXT_ID, MAP_GET_FD_BY_ID, "map")):
        for obj_id in _ids(cmd_next):
            try:
                fd = _bpf(cmd_fd, struct.pack("<I", obj_id))
            except OSError:
                continue  # freed meanwhile
            try:
                name = _prog_info(fd)[0] if kind == "prog" else _map_name(fd)
            finally:
                os.close(fd)
            if ((name in want_progs) if kind == "prog"
                    else name in (map_name(tag), counter_map_name(tag))):
                left.append(f"bpf {kind} {obj_id} {name}")
    return left


def attach_policy(cgroup_dir: Path, tag: str) -> tuple[AllowMap, CounterMap]:
    """Create the sandbox's (empty: deny-all) map and its counters, load and attach the six
    programs."""
    map_fd = create_map(map_name(tag))
    try:
        counters_fd = create_counter_map(counter_map_name(tag))
    except BaseException:
        os.close(map_fd)
        raise
    fds: list[int] = []
    cg = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        c = counters_fd
        progs = {
            "connect4": (PROG_TYPE_CGROUP_SOCK_ADDR, sock_addr4_program(map_fd, c, "connect4")),
            "sendmsg4": (PROG_TYPE_CGROUP_SOCK_ADDR, sock_addr4_program(map_fd, c, "sendmsg4")),
            "connect6": (PROG_TYPE_CGROUP_SOCK_ADDR, sock_addr6_program(c, "connect6")),
            "sendmsg6": (PROG_TYPE_CGROUP_SOCK_ADDR, sock_addr6_program(c, "sendmsg6")),
            "egress": (PROG_TYPE_CGROUP_SKB, skb_program(map_fd, True, c)),
            "ingress": (PROG_TYPE_CGROUP_SKB, skb_program(map_fd, False, c)),
        }
        for hook, attach_type in HOOKS:
            ptype, insns = progs[hook]
            fd = load_program(ptype, insns, prog_name(hook, tag),
                              attach_type if ptype == PROG_TYPE_CGROUP_SOCK_ADDR else 0)
            fds.append(fd)
            attach(cg, fd, attach_type)
    except BaseException:
        os.close(map_fd)
        os.close(counters_fd)
        raise
    finally:
        for fd in fds:
            os.close(fd)  # the attachment holds the programs (and they the maps)
        os.close(cg)
    return AllowMap(map_fd), CounterMap(counters_fd)


def find_policy(cgroup_dir: Path) -> tuple[AllowMap, CounterMap | None] | None:
    """The allow map and counters of programs already attached to cgroup_dir (after an edge
    restart); no counters for programs loaded by an edge that predates them."""
    try:
        cg = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        for prog_id in query(cg, ATTACH_EGRESS):
            pfd = _bpf(PROG_GET_FD_BY_ID, struct.pack("<I", prog_id))
            try:
                name, map_ids = _prog_info(pfd)
            finally:
                os.close(pfd)
            if not name.startswith(PROG_PREFIX[:3]) or not map_ids:
                continue
            allow: AllowMap | None = None
            counters: CounterMap | None = None
            for map_id in map_ids:
                mfd = _bpf(MAP_GET_FD_BY_ID, struct.pack("<I", map_id))
                mname = _map_name(mfd)
                if mname.startswith(PROG_PREFIX) and allow is None:
                    allow = AllowMap(mfd)
                elif mname.startswith(COUNTER_PREFIX) and counters is None:
                    counters = CounterMap(mfd)
                else:
                    os.close(mfd)
            if allow is not None:
                return allow, counters
            if counters is not None:
                counters.close()
        return None
    finally:
        os.close(cg)


def attached_programs(cgroup_dir: Path) -> list[int]:
    """Ids of rollbox programs attached to cgroup_dir, over all hooks (leak checks)."""
    try:
        cg = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return []
    try:
        return [i for _, t in HOOKS for i in query(cg, t)]
    finally:
        os.close(cg)
