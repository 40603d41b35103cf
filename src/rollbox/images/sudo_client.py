#!/usr/bin/python3 -IS
"""The ``/usr/bin/sudo`` rollbox ships into images labelled ``rollbox.sudo`` (e.g. e2b-base):
a client of the agent's sudo socket, not a setuid program (every sandbox process runs with
no_new_privs, so setuid never raises anything). It parses sudo's command line the way sudo
does for the forms scripts use (``-u``, ``-g``, ``-E``, ``--preserve-env[=LIST]``, ``-i``,
``-s``, ``-H``, ``-n``, ``-k``, ``-S``, ``-v``, ``-V``, ``--``, leading ``VAR=value``), builds
the environment sudo's ``env_reset`` would (Debian's ``secure_path``), and asks the agent
(``/dev/rollbox-sudo.sock``: SO_PEERCRED decides who may) to run the command with this
process's stdin, stdout and stderr, cwd and that environment; it forwards the signals a
terminal or a caller sends it and exits with the command's status.

Runs inside the sandbox as the sandbox's user, with only the standard library; it decides
nothing about privileges (the agent does: ``native/agent/agent.c``, "agent-mediated sudo").
It must not import rollbox (the image has no rollbox) and is never run by the platform.
"""
# Only C modules and os/struct/sys: `re`, `socket` and `signal` (enum) cost more start-up
# than the rest of a `sudo true` in the client.
import _signal
import _socket
import os
import pwd
import struct
import sys

SOCK = "/dev/rollbox-sudo.sock"
MAGIC = b"rbsudo1\0"
SECURE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# sudo's env_reset keeps these (and LC_*) from the caller's environment.
KEEP = {"TERM", "COLORTERM", "DISPLAY", "COLORS", "HOSTNAME", "LS_COLORS", "PS1", "PS2", "TZ",
        "LANG", "LANGUAGE", "LINGUAS", "XAUTHORITY", "XAUTHORIZATION", "KRB5CCNAME"}
FORWARD = (_signal.SIGINT, _signal.SIGTERM, _signal.SIGHUP, _signal.SIGQUIT, _signal.SIGUSR1,
           _signal.SIGUSR2, _signal.SIGWINCH, _signal.SIGCONT, _signal.SIGALRM)
USAGE = ("usage: sudo [-EHiknsSv] [-u user] [-g group] [--preserve-env[=list]] [VAR=value] "
         "[--] command [arg ...]")


def die(msg: str, code: int = 1) -> "None":
    sys.stderr.write(f"sudo: {msg}\n")
    sys.exit(code)


def parse(args: list[str]) -> dict:
    opts = {"user": None, "group": None, "preserve": False, "keep": set(), "login": False,
            "shell": False, "validate": False}
    longs = {"--user": "u", "--group": "g", "--login": "i", "--shell": "s",
             "--non-interactive": "n", "--set-home": "H", "--reset-timestamp": "k",
             "--remove-timestamp": "K", "--stdin": "S", "--validate": "v", "--version": "V",
             "--help": "h", "--preserve-env": "E"}
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":
            i += 1
            break
        if not a.startswith("-") or a == "-":
            break
        if a.startswith("--"):
            name, eq, val = a.partition("=")
            if name not in longs:
                die(f"unrecognized option '{a}'\n{USAGE}")
            flag = longs[name]
            if flag == "E" and eq:
                opts["keep"].update(v for v in val.split(",") if v)
                i += 1
                continue
            flags = flag + val if flag in "ug" else flag  # `--user=x` is `-ux`
        else:
            flags = a[1:]
        j = 0
        while j < len(flags):
            f = flags[j]
            if f in "ug":
                val = flags[j + 1:]
                if not val:
                    i += 1
                    if i >= len(args):
                        die(f"option requires an argument -- '{f}'\n{USAGE}")
                    val = args[i]
                opts["user" if f == "u" else "group"] = val
                break
            if f == "E":
                opts["preserve"] = True
            elif f == "i":
                opts["login"] = True
            elif f == "s":
                opts["shell"] = True
            elif f == "v":
                opts["validate"] = True
            elif f == "V":
                print("Sudo version 1.9 (rollbox agent-mediated sudo)")
                sys.exit(0)
            elif f == "h":
                print(USAGE)
                sys.exit(0)
            elif f in "nHkKSAb":
                pass  # no password is ever asked; HOME is always the target's
            else:
                die(f"invalid option -- '{f}'\n{USAGE}")
            j += 1
        i += 1
    rest = args[i:]
    assigns = {}
    while rest and is_assignment(rest[0]):
        k, _, v = rest.pop(0).partition("=")
        assigns[k] = v
    return {**opts, "assigns": assigns, "command": rest}


def is_assignment(arg: str) -> bool:
    """NAME=value with NAME a shell variable name (what sudo takes as an env setting)."""
    name, eq, _ = arg.partition("=")
    return bool(eq and name and name.isascii() and not name[0].isdigit()
                and all(c.isalnum() or c == "_" for c in name))


def lookup_user(spec: str | None) -> pwd.struct_passwd:
    try:
        if spec is None:
            return pwd.getpwuid(0)
        if spec.startswith("#"):
            return pwd.getpwuid(int(spec[1:]))
        return pwd.getpwnam(spec)
    except (KeyError, ValueError):
        die(f"unknown user {spec}")
        raise


def escape(arg: str) -> str:
    """sudo -i/-s: every character but ASCII letters, digits, `_`, `-` and `$` escaped."""
    return "".join(c if (c.isascii() and c.isalnum()) or c in "_-$" else "\\" + c
                   for c in arg)


def main() -> int:
    o = parse(sys.argv[1:])
    if o["validate"]:
        return 0
    target = lookup_user(o["user"])
    gid = target.pw_gid
    if o["group"] is not None:
        try:
            g = o["group"]
            import grp
            gid = int(g[1:]) if g.startswith("#") else grp.getgrnam(g).gr_gid
        except (KeyError, ValueError):
            die(f"unknown group {o['group']}")
    me = pwd.getpwuid(os.getuid()) if os.getuid() != 0 else None
    caller = os.environ
    shell = target.pw_shell or "/bin/sh"
    command = o["command"]
    cwd = os.getcwd() if os.path.isdir(".") else "/"
    if o["login"] or o["shell"]:
        sh = shell if o["login"] else caller.get("SHELL", shell)
        argv = [sh, "-l"] if o["login"] else [sh]
        if command:
            argv += ["-c", " ".join(escape(a) for a in command)]
        if o["login"]:
            cwd = target.pw_dir
    elif not command:
        die(USAGE)
    else:
        argv = list(command)
    if o["preserve"]:
        env = dict(caller)
    else:
        env = {k: v for k, v in caller.items()
               if k in KEEP or k.startswith("LC_") or k in o["keep"]}
    if not o["preserve"] or "HOME" not in env:
        env["HOME"] = target.pw_dir
    env.update({"PATH": SECURE_PATH, "SHELL": shell, "USER": target.pw_name,
                "LOGNAME": target.pw_name, "MAIL": f"/var/mail/{target.pw_name}",
                "SUDO_COMMAND": " ".join(argv)[:4096], "SUDO_USER": me.pw_name if me else "root",
                "SUDO_UID": str(os.getuid()), "SUDO_GID": str(os.getgid())})
    env.update(o["assigns"])
    try:
        s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_SEQPACKET)
        s.connect(SOCK)
    except OSError as exc:
        die(f"no privilege raising in this sandbox ({SOCK}: {exc.strerror})")
    strings = [cwd, *argv, *(f"{k}={v}" for k, v in env.items())]
    req = MAGIC + struct.pack("<IIII", target.pw_uid, gid, len(argv), len(env)) + b"".join(
        os.fsencode(x) + b"\0" for x in strings)
    if len(req) > 64 * 1024:
        die("argument list and environment too long (64 KiB)")
    for sig in FORWARD:  # a terminal's ^C reaches us: the command gets it
        _signal.signal(sig, lambda n, _f: _send_signal(s, n))
    try:
        s.sendmsg([req], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, struct.pack("3i", 0, 1, 2))])
    except OSError:
        pass  # refused before the request was read: the agent's answer is waiting
    while True:
        try:
            reply = s.recv(512)
            break
        except InterruptedError:
            continue
        except OSError as exc:
            die(f"{SOCK}: {exc.strerror}")
    if len(reply) < 8:
        die("the agent closed the connection")
    kind, value = struct.unpack_from("<ii", reply)
    if kind == 0:
        return value
    if kind == 1:
        _signal.signal(value, _signal.SIG_DFL)
        os.kill(os.getpid(), value)
        return 128 + value
    message = reply[8:].decode("utf-8", "replace")
    if message.startswith("exec ") and value == 2:  # ENOENT: sudo's wording
        die(f"{argv[0]}: command not found")
    die(message or os.strerror(value))
    return 1


def _send_signal(s: _socket.socket, signo: int) -> None:
    try:
        s.send(struct.pack("<i", signo))
    except OSError:
        pass


if __name__ == "__main__":
    sys.exit(main())
