/*
 * rollbox-agent: the in-sandbox exec agent (PID 1 of a container sandbox, or a microVM's init).
 *
 * Wire protocol: src/rollbox/agent/protocol.py (the contract; keep in sync).
 * Transports:
 *  - container: fd 3 is an inherited listening AF_UNIX SOCK_SEQPACKET socket (one packet per
 *    message, SCM_RIGHTS for session cgroups);
 *  - stream: fd 3 is a listening SOCK_STREAM socket, or (guest mode) the virtio-serial port
 *    org.rollbox.agent: length-prefixed frames, a HELLO/SYNC handshake per host connection
 *    (so a new host connection resyncs whatever the old one left half-sent), no descriptors.
 * Guest mode (PID 1 with no fd 3, i.e. started by a kernel): the agent first builds the
 * sandbox root (guest_init: /proc, /sys, /dev, cgroup2, modules, EROFS layers, ext4 upper,
 * overlayfs), then serves; commands run chrooted there in per-session cgroups it makes itself.
 * One edge connection at a time; a new connection replaces the old one. Single-threaded epoll
 * loop; every fd is CLOEXEC and non-blocking on our side; nothing here ever blocks forever, and
 * bad input only drops the connection (logged to stderr), never the agent.
 *
 * Memory: no big static buffers. A 64 KiB read buffer and a 128 KiB receive buffer are
 * allocated on first use; per-session state and the output retention rings are allocated per
 * session. Output is bounded by the per-session stream_limit/tail_limit and by backpressure
 * (pipes are not read while the edge socket is congested), so the agent never buffers
 * unboundedly. A session (exit status + the last tail_limit bytes per stream) stays until the
 * edge COLLECTs it, so a restarted edge can rebuild it; uncollected exited sessions are
 * bounded (RETAINED_EXITED_MAX, RETAINED_BYTES_MAX), running ones by MAX_SESSIONS, and all
 * rings together by RING_BYTES_MAX (past it a ring stops growing and keeps fewer bytes).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <malloc.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <linux/random.h>
#include <net/if.h>
#include <poll.h>
#include <sched.h>
#include <sys/epoll.h>
#include <sys/inotify.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/sysmacros.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <termios.h>
#include <sys/xattr.h>
#include <limits.h>
#include <time.h>
#include <unistd.h>

#define PROTOCOL_VERSION 3
#define MAX_PACKET (128 * 1024)
#define CHUNK (64 * 1024)
#define HDR 8
#define LISTEN_FD 3
#define AGENT_EXE_FD 4
#define PLATFORM_SHELL_FD 5 /* the platform's shell (bash-static), never a path of the sandbox */
#define PLATFORM_TOOL_FD 6  /* the platform's busybox (container mode, when the edge passes it) */

/* edge -> agent */
enum { M_EXEC = 1, M_STDIN = 2, M_STDIN_CLOSE = 3, M_SIGNAL = 4, M_KILL = 5, M_PING = 6,
       M_PONG = 7, M_LIST = 8, M_REPLAY = 9, M_COLLECT = 10, M_RESEED = 11,
       M_SET_MACHINE_ID = 12, M_SET_HOSTNAME = 13, M_SET_CLOCK = 14, M_BOOT_INFO = 15,
       M_HELLO = 16, M_RESIZE = 17, M_SUDO = 18 };
/* agent -> edge */
enum { M_READY = 32, M_STARTED = 33, M_SPAWN_FAILED = 34, M_STDOUT = 35, M_STDERR = 36,
       M_EXITED = 37, M_TAIL_STDOUT = 38, M_TAIL_STDERR = 39, M_SESSIONS = 40,
       M_STDIN_ACK = 41, M_REPLAY_OUT = 42, M_REPLAY_ERR = 43, M_REPLAY_END = 44,
       M_RESULT = 45, M_BOOT_INFO_REPLY = 46, M_SYNC = 47 };

#define EXEC_STDIN 1u
#define EXEC_CGROUP 2u
#define EXEC_PLATFORM_SHELL 4u /* argv runs under the platform shell (exec'd from its fd) */
#define EXEC_PLATFORM_TOOL 8u  /* argv[0] names a busybox applet of the platform's busybox, or
                                  * a tool built into the agent (XATTR_TOOL, ...) */
/* With EXEC_PLATFORM_TOOL in guest mode: run in the sandbox's own root (where its commands run:
 * the host masks hidden paths there), not the tools' view. */
#define EXEC_TOOL_IN_SANDBOX 16u
/* A terminal: the command's stdin, stdout and stderr are the slave of a pty opened on the
 * sandbox's own devpts (its controlling terminal, the command a session leader); the master is
 * the session's one output stream (stdout) and its stdin. The head is followed by <HH cols,
 * rows (1..PTY_MAX_SIZE) before the strings. */
#define EXEC_PTY 32u
/* With EXEC_PTY: stderr stays its own pipe (the session's second stream), stdin and stdout are
 * the terminal. A program that writes its errors to fd 2 is then not on the terminal; a shell
 * that joins 2 to 1 for its command keeps fd 2 as a channel the terminal can not write. */
#define EXEC_PTY_STDERR 64u
#define EXEC_KNOWN_FLAGS (EXEC_STDIN | EXEC_CGROUP | EXEC_PLATFORM_SHELL | EXEC_PLATFORM_TOOL | \
                          EXEC_TOOL_IN_SANDBOX | EXEC_PTY | EXEC_PTY_STDERR)
#define PTY_SIZE_LEN 4
#define PTY_MAX_SIZE 1000
#define DEVPTS_MAGIC 0x1cd1
#define EXEC_HEAD_SIZE 36 /* <IIIIQIII */
#define EXITED_SIZE 44    /* <iiBxxxQQQQ */
#define SESSION_ENTRY_SIZE 52 /* <IiBBxxiiQQQQ */

/* Bounds on what the agent holds for the edge. */
#define PENDING_EXITED_MAX 4096       /* EXITED kept while no edge is connected */
#define OUTQ_SOFT_MAX (4u << 20)      /* stop reading requests while the send queue is this big */
/* Stdin is credit-based (STDIN_ACK): the edge keeps at most STDIN_WINDOW unacknowledged bytes
 * per session, so a command that never reads stdin can't stall the connection. An edge that
 * overruns the window (plus one packet of slack) is dropped. */
#define STDIN_WINDOW (256u << 10)
#define STDIN_BACKLOG_MAX (STDIN_WINDOW + MAX_PACKET)
#define TAIL_LIMIT_MAX (16u << 20)
/* Retention: every session keeps the last tail_limit bytes per stream (a ring, grown on
 * demand) and, once over, its exit status, until the edge COLLECTs it; a restarted edge
 * rebuilds the session from it (LIST, REPLAY). Exited sessions nobody collected are bounded in
 * number and in retained bytes (the oldest go first), running ones by MAX_SESSIONS. */
#define MAX_SESSIONS 1024
#define RETAINED_EXITED_MAX 256
#define RETAINED_BYTES_MAX (16u << 20)
#define RING_BYTES_MAX (64u << 20)
#define RING_MIN (4u << 10)
#define TAIL_SEND_MAX (64u << 10)    /* TAIL_* at exit: the last bytes of the ring, at most */
#define DRAIN_MS 50                   /* how long pipes are drained after the main process exits */
#define FINAL_DRAIN_MAX (256u << 10)  /* last non-blocking read per stream at the drain deadline */
#define READS_PER_TURN 4              /* chunks per stream per loop turn (fairness) */
/* Stream transport: each message is a little-endian u32 length (HDR..MAX_PACKET) then the
 * packet. A host connection starts with HELLO (HELLO_MAGIC + 8-byte nonce); until the agent
 * has seen one it only scans for the magic, and it answers with a SYNC frame (SYNC_MAGIC +
 * the same nonce) before READY, so the host can skip whatever an earlier connection left in
 * the byte stream. */
#define FRAME_PREFIX 4
#define HELLO_MAGIC "rollbox-hello-v1"
#define SYNC_MAGIC "rollbox-sync--v1"
#define MAGIC_LEN 16
#define NONCE_LEN 8
#define STREAM_IN_CAP (FRAME_PREFIX + MAX_PACKET + CHUNK)
/* Guest mode */
#define SANDBOX_ROOT "/sandbox"
/* Where the platform's tools run in guest mode (the host's file API and snapshots): a bind of
 * the sandbox's overlay alone, so they see its files as a container's host-side file API does
 * (none of the sandbox's /proc, /dev, /run mounts or masks over hidden paths), with the
 * overlay upper read-only over its /proc, a directory nothing of the sandbox's sees (its own
 * /proc is procfs): busybox tar reads whiteouts there for a snapshot. */
#define TOOL_VIEW "/view"
#define TOOL_VIEW_UPPER TOOL_VIEW "/proc"
#define GUEST_PORT_NAME "org.rollbox.agent"
/* A disk image guest's agent after the hand-over (hand_over): in no cgroup of the image's init */
#define AGENT_CGROUP "/sys/fs/cgroup/rollbox-agent"
#define GUEST_DEVICE_WAIT_MS 20000
#define BOOT_ERR_MAX 200

enum watch_kind { W_LISTEN, W_CONN, W_SIGNAL, W_OUT, W_ERR, W_IN, W_PIDS, W_SUDO_LISTEN,
                  W_SUDO_CONN };

struct session;
struct watch {
    enum watch_kind kind;
    struct session *s;
};

struct ring {
    char *buf;
    size_t cap, start, len;
};

enum sess_state { S_SPAWNING, S_RUNNING, S_FAILED, S_EXITED };

struct session {
    struct session *next;
    uint32_t id;
    pid_t pid;
    enum sess_state state;
    int cgfd, in_fd;
    int out_fd[2];
    int out_ready[2];
    int in_ready, in_close_pending;
    int is_pty; /* out_fd[0] is the pty master, in_fd a dup of it (out_fd[1] is -1, or the
                 * stderr pipe with EXEC_PTY_STDERR) */
    char *in_buf;
    size_t in_len;
    uint64_t stream_limit, total[2], dropped[2];
    size_t tail_limit;
    struct ring tail[2];
    int reaped, wstatus, timed_out, oom_kills;
    uint64_t cg_seq; /* guest mode: the session cgroup the agent made (0: none) */
    int cg_oom_base;  /* its oom_kill count when the session got it (a reused cgroup) */
    uint64_t exited_seq; /* order of exit, for evicting the oldest uncollected session */
    int64_t deadline_ms, drain_deadline_ms;
    struct watch w_out, w_err, w_in;
};

struct qpkt {
    struct qpkt *next;
    size_t len, off;
    int is_exited;
    char data[];
};

static int ep = -1, sig_fd = -1, conn_fd = -1;
static struct watch w_listen = {W_LISTEN, NULL}, w_signal = {W_SIGNAL, NULL};
static struct watch w_pids = {W_PIDS, NULL};
/* Two alternating watches: an event still pending for a replaced connection is recognised. */
static struct watch w_conns[2] = {{W_CONN, NULL}, {W_CONN, NULL}};
static struct watch *w_conn = &w_conns[0];
static uint32_t conn_events;
static struct session *sessions;
static size_t session_count, exited_count, exited_bytes, ring_bytes;
static uint64_t exit_seq;
static struct qpkt *outq_head, *outq_tail;
static size_t outq_bytes;
static struct qpkt *pend_head, *pend_tail;
static size_t pend_count;
static char *rdbuf;   /* HDR + CHUNK, lazily allocated */
static char *rxbuf;   /* MAX_PACKET, lazily allocated */
static int more_work; /* some pump stopped early; poll again without sleeping */
static int shell_fd = -1; /* PLATFORM_SHELL_FD when the edge passed one */
static int tool_fd = -1;  /* the platform's busybox: PLATFORM_TOOL_FD, or /platform/busybox */
static int self_fd = -1;  /* this agent's own binary (the built-in tools are exec'd from it) */
/* Transport: stream framing (a SOCK_STREAM listener, or the guest's virtio port). */
static int stream_mode, guest_mode, conn_is_port, port_et;
enum { C_HUNT, C_LIVE } conn_state; /* stream: LIVE once a HELLO was seen */
static unsigned char conn_nonce[NONCE_LEN];
static char *inbuf;   /* stream receive buffer (STREAM_IN_CAP), lazily allocated */
static size_t in_have;
static unsigned in_gen; /* bumped when the input buffer is discarded (drop_conn) */
/* Guest mode: the sandbox root, where commands run (chroot); cgroup sequence; boot record. */
static int root_fd = -1;
static int view_fd = -1; /* TOOL_VIEW: the platform tools' root */
static uint64_t cg_counter;
static uint64_t t_init, t_modules, t_disks, t_mounts, t_ready; /* CLOCK_BOOTTIME ns */
static int boot_errno;
static char boot_err[BOOT_ERR_MAX];
/* Guest mode: the kernel's arguments to /init (a disk image's init gets them, see hand_over). */
static int guest_argc;
static char **guest_argv;

static void logmsg(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void logmsg(const char *fmt, ...)
{
    char buf[512];
    va_list ap;
    int n = snprintf(buf, sizeof buf, "rollbox-agent: ");
    va_start(ap, fmt);
    vsnprintf(buf + n, sizeof buf - (size_t)n, fmt, ap);
    va_end(ap);
    size_t len = strnlen(buf, sizeof buf - 2);
    buf[len++] = '\n';
    ssize_t w = write(2, buf, len);
    (void)w;
}

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void put_u32(char *p, uint32_t v) { memcpy(p, &v, 4); } /* x86/arm little endian */
static void put_u64(char *p, uint64_t v) { memcpy(p, &v, 8); }
static uint32_t get_u32(const char *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static uint64_t get_u64(const char *p) { uint64_t v; memcpy(&v, p, 8); return v; }

static void set_header(char *p, int type, uint32_t session)
{
    p[0] = (char)type;
    p[1] = 0;
    p[2] = 0;
    p[3] = 0;
    put_u32(p + 4, session);
}

static void ep_add(int fd, uint32_t events, struct watch *w)
{
    struct epoll_event ev = {.events = events, .data.ptr = w};
    if (epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev) < 0)
        logmsg("epoll add fd %d: %s", fd, strerror(errno));
}

static void close_watched(int *fd)
{
    if (*fd >= 0) {
        epoll_ctl(ep, EPOLL_CTL_DEL, *fd, NULL);
        close(*fd);
        *fd = -1;
    }
}

/* The descriptors a received message brought (SCM_RIGHTS), for every recvmsg from a peer:
 * up to max of them into fds[] (their count returned; the caller owns them), or -1 when the
 * message is not one to act on: more than max descriptors, a control message of another kind,
 * or truncated (MSG_CTRUNC: the kernel installed the descriptors that fit the control buffer
 * and dropped the rest; MSG_TRUNC: data cut at the buffer). On -1 every descriptor it brought
 * is closed. Call it on every recvmsg that returned >= 0, a zero-length message too: a
 * SEQPACKET message carries descriptors without data. */
static int take_fds(struct msghdr *mh, int *fds, int max)
{
    int n = 0, bad = (mh->msg_flags & (MSG_TRUNC | MSG_CTRUNC)) != 0;
    const char *end = (const char *)mh->msg_control + mh->msg_controllen;
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(mh); cm; cm = CMSG_NXTHDR(mh, cm)) {
        if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS ||
            cm->cmsg_len < CMSG_LEN(0)) {
            bad = 1;
            continue;
        }
        size_t len = cm->cmsg_len - CMSG_LEN(0), room = (size_t)(end - (char *)CMSG_DATA(cm));
        for (size_t j = 0; j < (len < room ? len : room) / sizeof(int); j++) {
            int fd;
            memcpy(&fd, CMSG_DATA(cm) + j * sizeof(int), sizeof fd);
            if (n < max) {
                fds[n++] = fd;
            } else {
                close(fd);
                bad = 1;
            }
        }
    }
    if (!bad)
        return n;
    while (n > 0)
        close(fds[--n]);
    return -1;
}

/* ---------- edge connection: send queue ---------- */

/* An edge is connected and has said hello (seqpacket: from accept on). */
static int conn_up(void) { return conn_fd >= 0 && conn_state == C_LIVE; }

static void update_conn_events(void)
{
    if (conn_fd < 0 || port_et)
        return;
    uint32_t want = conn_is_port ? 0 : EPOLLRDHUP;
    if (outq_bytes < OUTQ_SOFT_MAX)
        want |= EPOLLIN;
    if (outq_head && conn_up())
        want |= EPOLLOUT;
    if (want != conn_events) {
        struct epoll_event ev = {.events = want, .data.ptr = w_conn};
        epoll_ctl(ep, EPOLL_CTL_MOD, conn_fd, &ev);
        conn_events = want;
    }
}

static void drop_conn(const char *why);
static void remove_session_cgroup(uint64_t seq);
static int pool_session_cgroup(uint64_t seq, int cgfd, int oom_total);
static void boot_fail(int err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int cgroup_oom_kills(int cgfd);
static int write_file(const char *path, const char *text);
static void resolve_spawn(struct session *s, int step, int err, const char *cwd,
                          const char *argv0);
static void read_conn(int hangup);
static void ensure_stdio(void);
static int handle_packet(const char *pkt, size_t len, int fd);
static int handle_sudo_enable(uint32_t id, const char *p, size_t plen);
static int sudo_reaped(pid_t pid, int status);
static void sudo_accept(void);
static void sudo_conn_event(int i, uint32_t events);
static int sudo_slot(const struct watch *w);
static int handle_reseed(uint32_t id, const char *p, size_t plen);
static int handle_machine_id(uint32_t id, const char *p, size_t plen);
static void handle_boot_info(uint32_t id);
static int send_result(uint32_t id, int err, const char *what);
static int sysfs_dev(const char *dir, const char *prefix, const char *attr, const char *want,
                     char *dev, size_t n, int need_node);

static void pend_push(struct qpkt *q)
{
    if (pend_count >= PENDING_EXITED_MAX) {
        logmsg("pending EXITED queue full, dropping one");
        free(q);
        return;
    }
    q->next = NULL;
    q->off = 0;
    if (pend_tail)
        pend_tail->next = q;
    else
        pend_head = q;
    pend_tail = q;
    pend_count++;
}

static void outq_push(struct qpkt *q)
{
    q->next = NULL;
    if (outq_tail)
        outq_tail->next = q;
    else
        outq_head = q;
    outq_tail = q;
    outq_bytes += q->len;
}

/* Write (part of) a queued message: whole packets on seqpacket, bytes on a stream. */
static ssize_t conn_write(const char *data, size_t len)
{
    if (stream_mode)
        return conn_is_port ? write(conn_fd, data, len)
                            : send(conn_fd, data, len, MSG_DONTWAIT | MSG_NOSIGNAL);
    return send(conn_fd, data, len, MSG_DONTWAIT | MSG_NOSIGNAL);
}

static void flush_outq(void)
{
    while (conn_up() && outq_head) {
        struct qpkt *q = outq_head;
        ssize_t n = conn_write(q->data + q->off, q->len - q->off);
        if (n < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)
                break;
            drop_conn("send failed");
            return;
        }
        q->off += (size_t)n;
        if (q->off < q->len)
            continue; /* a stream took part of it: try the rest (EAGAIN ends the loop) */
        outq_head = q->next;
        if (!outq_head)
            outq_tail = NULL;
        outq_bytes -= q->len;
        free(q);
    }
    update_conn_events();
}

/* A queued copy of a packet, as the transport writes it (stream: with its length prefix). */
static struct qpkt *make_qpkt(const char *data, size_t len, int is_exited)
{
    size_t pre = stream_mode ? FRAME_PREFIX : 0;
    struct qpkt *q = malloc(sizeof *q + pre + len);
    if (!q)
        return NULL;
    if (pre)
        put_u32(q->data, (uint32_t)len);
    memcpy(q->data + pre, data, len);
    q->len = pre + len;
    q->off = 0;
    q->is_exited = is_exited;
    q->next = NULL;
    return q;
}

/* Send a packet now if possible, else queue a copy. Returns 0 when sent/queued. */
static int send_packet(const char *data, size_t len, int is_exited)
{
    if (!conn_up()) {
        if (!is_exited)
            return -1;
        struct qpkt *q = make_qpkt(data, len, 1);
        if (!q)
            return -1;
        pend_push(q);
        return 0;
    }
    size_t sent = 0;
    if (!outq_head) {
        ssize_t n;
        if (stream_mode) {
            char pre[FRAME_PREFIX];
            put_u32(pre, (uint32_t)len);
            struct iovec iov[2] = {{pre, FRAME_PREFIX}, {(void *)data, len}};
            n = writev(conn_fd, iov, 2); /* the port and stream sockets: non-blocking fds */
        } else {
            n = send(conn_fd, data, len, MSG_DONTWAIT | MSG_NOSIGNAL);
        }
        if (n >= 0 && (size_t)n == len + (stream_mode ? FRAME_PREFIX : 0))
            return 0;
        if (n >= 0)
            sent = (size_t)n; /* a stream took part of it: queue the rest */
        else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
            drop_conn("send failed");
            return send_packet(data, len, is_exited);
        }
    }
    struct qpkt *q = make_qpkt(data, len, is_exited);
    if (!q) {
        logmsg("out of memory queueing a packet");
        if (sent)
            drop_conn("out of memory mid-frame"); /* the stream can't be left half a frame */
        return -1;
    }
    q->off = sent;
    outq_push(q);
    update_conn_events();
    return 0;
}

static void send_small(int type, uint32_t session, const void *payload, size_t plen)
{
    char buf[HDR + 256];
    if (plen > sizeof buf - HDR)
        plen = sizeof buf - HDR;
    set_header(buf, type, session);
    if (plen)
        memcpy(buf + HDR, payload, plen);
    send_packet(buf, HDR + plen, type == M_EXITED);
}

/* Forget what was queued for the connection; its EXITED are kept for the next one. */
static void discard_outq(void)
{
    struct qpkt *q = outq_head;
    while (q) {
        struct qpkt *next = q->next;
        if (q->is_exited)
            pend_push(q);
        else
            free(q);
        q = next;
    }
    outq_head = outq_tail = NULL;
    outq_bytes = 0;
    free(rxbuf);
    rxbuf = NULL;
}

static void drop_conn(const char *why)
{
    if (conn_fd < 0 || (conn_is_port && conn_state != C_LIVE))
        return;
    logmsg("dropping edge connection: %s", why);
    discard_outq();
    if (conn_is_port) {
        /* The port stays open: wait for the next HELLO (a new host connection, or this one
         * resyncing). Input of the dropped connection is discarded. */
        conn_state = C_HUNT;
        memset(conn_nonce, 0, sizeof conn_nonce);
        in_have = 0;
        in_gen++;
    } else {
        close_watched(&conn_fd);
        conn_events = 0;
        conn_state = C_HUNT;
        in_have = 0;
        in_gen++;
    }
    update_conn_events();
}

/* The connection is established (seqpacket: accepted; stream: HELLO seen): READY, then the
 * EXITED of sessions that ended while nobody listened. */
static void conn_established(void)
{
    conn_state = C_LIVE;
    if (stream_mode) {
        char sync[HDR + MAGIC_LEN + NONCE_LEN];
        set_header(sync, M_SYNC, 0);
        memcpy(sync + HDR, SYNC_MAGIC, MAGIC_LEN);
        memcpy(sync + HDR + MAGIC_LEN, conn_nonce, NONCE_LEN);
        send_packet(sync, sizeof sync, 0);
    }
    char v[4];
    put_u32(v, PROTOCOL_VERSION);
    send_small(M_READY, 0, v, 4);
    while (pend_head && conn_up()) {
        struct qpkt *p = pend_head;
        pend_head = p->next;
        if (!pend_head)
            pend_tail = NULL;
        pend_count--;
        outq_push(p);
    }
    flush_outq();
}

/* HELLO (stream transports): a new host connection, unless it repeats the current nonce
 * (the host resends HELLO until it sees SYNC). */
static void on_hello(const unsigned char *nonce)
{
    if (conn_state == C_LIVE && memcmp(nonce, conn_nonce, NONCE_LEN) == 0)
        return;
    if (conn_state == C_LIVE) {
        /* Same transport, new host connection: drop what was queued for the old one. */
        logmsg("new host connection (HELLO)");
        discard_outq();
    }
    memcpy(conn_nonce, nonce, NONCE_LEN);
    conn_established();
}

static void accept_conn(void)
{
    for (;;) {
        int fd = accept4(LISTEN_FD, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0) {
            if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR &&
                errno != ECONNABORTED)
                logmsg("accept: %s", strerror(errno));
            return;
        }
        if (conn_fd >= 0) {
            conn_state = C_LIVE; /* a stream connection still waiting for HELLO goes too */
            drop_conn("replaced by a new connection");
        }
        conn_fd = fd;
        conn_events = EPOLLIN | EPOLLRDHUP;
        w_conn = w_conn == &w_conns[0] ? &w_conns[1] : &w_conns[0];
        ep_add(fd, conn_events, w_conn);
        if (stream_mode)
            conn_state = C_HUNT; /* nothing is sent before the host's HELLO */
        else
            conn_established();
    }
}

/* ---------- sessions ---------- */

static struct session *find_session(uint32_t id)
{
    for (struct session *s = sessions; s; s = s->next)
        if (s->id == id)
            return s;
    return NULL;
}

static void unlink_session(struct session *s)
{
    for (struct session **pp = &sessions; *pp; pp = &(*pp)->next)
        if (*pp == s) {
            *pp = s->next;
            return;
        }
}

static void free_session(struct session *s)
{
    unlink_session(s);
    session_count--;
    if (s->state == S_EXITED) {
        exited_count--;
        exited_bytes -= s->tail[0].cap + s->tail[1].cap;
    }
    close_watched(&s->out_fd[0]);
    close_watched(&s->out_fd[1]);
    close_watched(&s->in_fd);
    if (s->cgfd >= 0)
        close(s->cgfd);
    remove_session_cgroup(s->cg_seq); /* again: leftovers may have gone since the exit */
    free(s->in_buf);
    ring_bytes -= s->tail[0].cap + s->tail[1].cap;
    free(s->tail[0].buf);
    free(s->tail[1].buf);
    free(s);
}

static void kill_session(struct session *s)
{
    if (s->cgfd >= 0) {
        int fd = openat(s->cgfd, "cgroup.kill", O_WRONLY | O_CLOEXEC);
        if (fd >= 0) {
            if (write(fd, "1", 1) != 1)
                logmsg("session %u: cgroup.kill: %s", s->id, strerror(errno));
            close(fd);
        } else {
            logmsg("session %u: open cgroup.kill: %s", s->id, strerror(errno));
        }
    }
    if (s->pid > 0 && !s->reaped) {
        kill(-s->pid, SIGKILL); /* the main process is a session/group leader */
        kill(s->pid, SIGKILL);  /* in case it had not reached setsid() yet */
    }
}

/* Copy n bytes of the ring, starting `skip` bytes after its oldest byte, to dst. */
static void ring_copy(const struct ring *r, size_t skip, char *dst, size_t n)
{
    size_t pos = (r->start + skip) % r->cap;
    size_t first = r->cap - pos < n ? r->cap - pos : n;
    memcpy(dst, r->buf + pos, first);
    memcpy(dst + first, r->buf, n - first);
}

/* Grow the ring towards `limit` so that `want` bytes fit (best effort: on ENOMEM the ring
 * keeps its size and simply holds fewer bytes). */
static void ring_grow(struct ring *r, size_t limit, size_t want)
{
    if (r->cap >= limit || r->cap >= want)
        return;
    size_t cap = r->cap ? r->cap : RING_MIN;
    while (cap < want && cap < limit)
        cap *= 2;
    if (cap > limit)
        cap = limit;
    if (ring_bytes + (cap - r->cap) > RING_BYTES_MAX)
        return; /* the agent's budget for all rings: this one keeps what it has */
    char *buf = malloc(cap);
    if (!buf)
        return;
    if (r->len)
        ring_copy(r, 0, buf, r->len);
    free(r->buf);
    ring_bytes += cap - r->cap;
    r->buf = buf;
    r->cap = cap;
    r->start = 0;
}

/* Keep the last `limit` bytes of a stream. */
static void ring_put(struct ring *r, size_t limit, const char *data, size_t len)
{
    if (limit == 0 || len == 0)
        return;
    ring_grow(r, limit, r->len + len);
    if (r->cap == 0)
        return;
    if (len >= r->cap) {
        memcpy(r->buf, data + len - r->cap, r->cap);
        r->start = 0;
        r->len = r->cap;
        return;
    }
    size_t end = (r->start + r->len) % r->cap;
    size_t first = r->cap - end < len ? r->cap - end : len;
    memcpy(r->buf + end, data, first);
    memcpy(r->buf, data + first, len - first);
    r->len += len;
    if (r->len > r->cap) {
        r->start = (r->start + (r->len - r->cap)) % r->cap;
        r->len = r->cap;
    }
}

/* Account for `n` bytes (already in rdbuf + HDR) read from stream i: keep them in the
 * retention ring and forward what fits. */
static void handle_output(struct session *s, int i, size_t n)
{
    char *data = rdbuf + HDR;
    size_t fwd = 0;
    /* Only a live connection gets it (a stream connection still waiting for HELLO does not):
     * what is not sent counts as dropped, so TAIL_* at exit is sent exactly when the edge
     * missed bytes. */
    if (conn_up() && s->total[i] < s->stream_limit) {
        uint64_t room = s->stream_limit - s->total[i];
        fwd = n < room ? n : (size_t)room;
    }
    s->total[i] += n;
    ring_put(&s->tail[i], s->tail_limit, data, n);
    if (fwd) {
        set_header(rdbuf, i == 0 ? M_STDOUT : M_STDERR, s->id);
        send_packet(rdbuf, HDR + fwd, 0);
    }
    if (fwd < n)
        s->dropped[i] += n - fwd;
}

static int ensure_rdbuf(void)
{
    if (!rdbuf)
        rdbuf = malloc(HDR + CHUNK);
    return rdbuf ? 0 : -1;
}

/* Read from stream i. max_bytes bounds the total read in this call. */
static void pump(struct session *s, int i, size_t max_reads, int ignore_backpressure)
{
    if (s->out_fd[i] < 0 || ensure_rdbuf() < 0)
        return;
    for (size_t k = 0; k < max_reads; k++) {
        if (!ignore_backpressure && conn_fd >= 0 && outq_head)
            return; /* edge is congested: leave data in the pipe so the writer blocks */
        ssize_t n = read(s->out_fd[i], rdbuf + HDR, CHUNK);
        if (n > 0) {
            handle_output(s, i, (size_t)n);
            continue;
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            s->out_ready[i] = 0;
            return;
        }
        close_watched(&s->out_fd[i]); /* EOF or error */
        s->out_ready[i] = 0;
        return;
    }
    more_work = 1;
}

static void send_stdin_ack(uint32_t id, size_t n)
{
    if (n) {
        char v[4];
        put_u32(v, (uint32_t)n);
        send_small(M_STDIN_ACK, id, v, 4);
    }
}

/* Drop queued stdin (the command closed its stdin); the bytes still count as consumed. */
static void discard_stdin(struct session *s)
{
    size_t n = s->in_len;
    s->in_len = 0;
    free(s->in_buf);
    s->in_buf = NULL;
    close_watched(&s->in_fd);
    send_stdin_ack(s->id, n);
}

static void pump_stdin(struct session *s)
{
    size_t acked = 0;
    while (s->in_fd >= 0 && s->in_len > 0 && s->in_ready) {
        ssize_t n = write(s->in_fd, s->in_buf, s->in_len);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                s->in_ready = 0;
                break;
            }
            send_stdin_ack(s->id, acked);
            discard_stdin(s); /* EPIPE: the command closed its stdin */
            return;
        }
        memmove(s->in_buf, s->in_buf + n, s->in_len - (size_t)n);
        s->in_len -= (size_t)n;
        acked += (size_t)n;
    }
    send_stdin_ack(s->id, acked);
    if (s->in_len == 0 && s->in_buf) {
        free(s->in_buf);
        s->in_buf = NULL;
    }
    if (s->in_fd >= 0 && s->in_len == 0 && s->in_close_pending)
        close_watched(&s->in_fd);
}

static void send_tail(struct session *s, int i)
{
    struct ring *r = &s->tail[i];
    if (!s->dropped[i] || !r->buf || !r->len || ensure_rdbuf() < 0)
        return;
    size_t want = r->len < TAIL_SEND_MAX ? r->len : TAIL_SEND_MAX;
    size_t done = r->len - want;
    while (done < r->len) {
        size_t n = r->len - done < CHUNK ? r->len - done : CHUNK;
        ring_copy(r, done, rdbuf + HDR, n);
        set_header(rdbuf, i == 0 ? M_TAIL_STDOUT : M_TAIL_STDERR, s->id);
        send_packet(rdbuf, HDR + n, 0);
        done += n;
    }
}

static void exit_status(const struct session *s, int32_t *code, int32_t *sig)
{
    *code = -1;
    *sig = 0;
    if (WIFEXITED(s->wstatus))
        *code = WEXITSTATUS(s->wstatus);
    else if (WIFSIGNALED(s->wstatus))
        *sig = WTERMSIG(s->wstatus);
}

/* Free the oldest uncollected exited sessions while over the retention bounds. */
static void evict_exited(void)
{
    while (exited_count > RETAINED_EXITED_MAX || exited_bytes > RETAINED_BYTES_MAX) {
        struct session *oldest = NULL;
        for (struct session *s = sessions; s; s = s->next)
            if (s->state == S_EXITED && (!oldest || s->exited_seq < oldest->exited_seq))
                oldest = s;
        if (!oldest)
            return;
        logmsg("session %u: exit never collected, dropped (retention bound)", oldest->id);
        free_session(oldest);
    }
}

/* The main process is gone and its pipes are drained: report, then keep the session (its
 * rings and exit status) until the edge COLLECTs it. */
static void finish_session(struct session *s)
{
    if (conn_up()) {
        send_tail(s, 0);
        send_tail(s, 1);
    }
    char body[EXITED_SIZE];
    memset(body, 0, sizeof body);
    int32_t code, sig;
    exit_status(s, &code, &sig);
    memcpy(body, &code, 4);
    memcpy(body + 4, &sig, 4);
    body[8] = (char)(s->timed_out ? 1 : 0);
    int oom_total = 0;
    if (s->cgfd >= 0 && guest_mode) {
        oom_total = cgroup_oom_kills(s->cgfd);
        s->oom_kills = oom_total > s->cg_oom_base ? oom_total - s->cg_oom_base : 0;
    }
    body[9] = (char)(s->oom_kills > 255 ? 255 : s->oom_kills);
    put_u64(body + 12, s->total[0]);
    put_u64(body + 20, s->total[1]);
    put_u64(body + 28, s->dropped[0]);
    put_u64(body + 36, s->dropped[1]);
    send_small(M_EXITED, s->id, body, sizeof body);
    close_watched(&s->out_fd[0]);
    close_watched(&s->out_fd[1]);
    close_watched(&s->in_fd);
    if (s->cgfd >= 0) {
        if (pool_session_cgroup(s->cg_seq, s->cgfd, oom_total))
            s->cg_seq = 0; /* the pool's now */
        close(s->cgfd);
        s->cgfd = -1;
    }
    remove_session_cgroup(s->cg_seq);
    free(s->in_buf);
    s->in_buf = NULL;
    s->in_len = 0;
    s->state = S_EXITED;
    s->exited_seq = ++exit_seq;
    exited_count++;
    exited_bytes += s->tail[0].cap + s->tail[1].cap;
    /* evict_exited() runs after the caller's walk of the list: it may free any exited
     * session, the walk's next one included. */
}


/* ---- Landlock: commands get no access to the task's hidden paths (the platform's own binary
 * is not in the sandbox's tree at all: runc execs it from an inherited fd). A hidden path the
 * platform masked (a mount of an empty tmpfs or /dev/null over it: X is a mount root) needs no
 * path rule: any Landlock domain forbids its commands every mount, umount, move and
 * pivot_root, so the mask stays (a layer besides the missing CAP_SYS_ADMIN and seccomp), and
 * the ruleset grants everything else (no limit on new entries next to X). For a hidden path
 * that is not masked (absent when the sandbox started, e.g. written later by the platform)
 * Landlock is the layer: it only grants, so "everything but X" is: full access beneath every
 * entry of X's ancestor directories except X (and the next ancestor), and on the ancestors
 * themselves only listing, creating and removing entries (no reading/executing/writing file
 * contents, no cross-directory rename/link that could carry X out). Entries are enumerated at
 * each exec, so a top-level directory created by a command next to such an X is fully usable
 * from the next command on. The deny list comes once from the agent's own environment
 * (ROLLBOX_LANDLOCK_DENY, colon-separated); unset means off. If the kernel has no Landlock, it
 * is logged once and commands run without it (the mount masks and read-only binds remain). */
#define LL_CREATE_RULESET_VERSION 1u
#define LL_RULE_PATH_BENEATH 1
#define LL_EXECUTE (1ull << 0)
#define LL_WRITE_FILE (1ull << 1)
#define LL_READ_FILE (1ull << 2)
#define LL_READ_DIR (1ull << 3)
#define LL_REMOVE_DIR (1ull << 4)
#define LL_REMOVE_FILE (1ull << 5)
#define LL_MAKE_CHAR (1ull << 6)
#define LL_MAKE_DIR (1ull << 7)
#define LL_MAKE_REG (1ull << 8)
#define LL_MAKE_SOCK (1ull << 9)
#define LL_MAKE_FIFO (1ull << 10)
#define LL_MAKE_BLOCK (1ull << 11)
#define LL_MAKE_SYM (1ull << 12)
#define LL_REFER (1ull << 13)
#define LL_TRUNCATE (1ull << 14)
#define LL_IOCTL_DEV (1ull << 15)
#ifndef SYS_landlock_create_ruleset
#define SYS_landlock_create_ruleset 444
#define SYS_landlock_add_rule 445
#define SYS_landlock_restrict_self 446
#endif

struct ll_ruleset_attr {
    uint64_t handled_access_fs;
};
struct ll_path_beneath {
    uint64_t allowed_access;
    int32_t parent_fd;
} __attribute__((packed));

#define LL_MAX_DENY 64
static char *ll_deny[LL_MAX_DENY];
static int ll_ndeny;
/* The hidden paths that need path rules for the next command: those not masked. */
static const char *ll_act[LL_MAX_DENY];
static int ll_nact;
#ifndef STATX_ATTR_MOUNT_ROOT
#define STATX_ATTR_MOUNT_ROOT 0x00002000
#endif
static uint64_t ll_handled; /* 0: Landlock off */

static void landlock_init(void)
{
    const char *spec = getenv("ROLLBOX_LANDLOCK_DENY");
    if (!spec || !*spec)
        return;
    long abi = syscall(SYS_landlock_create_ruleset, NULL, 0, LL_CREATE_RULESET_VERSION);
    if (abi < 1) {
        logmsg("landlock unavailable (%s): commands run without it", strerror(errno));
        return;
    }
    ll_handled = (LL_MAKE_SYM << 1) - 1; /* ABI 1 */
    if (abi >= 2)
        ll_handled |= LL_REFER;
    if (abi >= 3)
        ll_handled |= LL_TRUNCATE;
    if (abi >= 5)
        ll_handled |= LL_IOCTL_DEV;
    char *copy = strdup(spec), *save = NULL;
    for (char *p = strtok_r(copy, ":", &save); p && ll_ndeny < LL_MAX_DENY;
         p = strtok_r(NULL, ":", &save))
        if (p[0] == '/' && p[1])
            ll_deny[ll_ndeny++] = strdup(p);
    free(copy);
    unsetenv("ROLLBOX_LANDLOCK_DENY");
}

/* Is the hidden path the root of a mount (the platform's mask; commands can not mount)? */
static int ll_is_masked(const char *path)
{
    struct statx stx;
    if (statx(AT_FDCWD, path, AT_SYMLINK_NOFOLLOW | AT_NO_AUTOMOUNT, STATX_TYPE, &stx) != 0)
        return 0;
    return (stx.stx_attributes_mask & STATX_ATTR_MOUNT_ROOT) &&
           (stx.stx_attributes & STATX_ATTR_MOUNT_ROOT);
}

static int ll_is_denied(const char *path)
{
    for (int i = 0; i < ll_nact; i++)
        if (strcmp(ll_act[i], path) == 0)
            return 1;
    return 0;
}

/* Is `path` a proper ancestor directory of a denied path? ("/" always is.) */
static int ll_is_ancestor(const char *path)
{
    size_t n = strlen(path);
    if (n == 1)
        return 1;
    for (int i = 0; i < ll_nact; i++)
        if (strncmp(ll_act[i], path, n) == 0 && ll_act[i][n] == '/')
            return 1;
    return 0;
}

static int ll_add(int rs, int fd, uint64_t access)
{
    struct ll_path_beneath pb = {access & ll_handled, fd};
    if (!pb.allowed_access)
        return 0;
    return (int)syscall(SYS_landlock_add_rule, rs, LL_RULE_PATH_BENEATH, &pb, 0);
}

/* Rules for one ancestor directory; returns -1 with errno set on failure. */
static int ll_add_ancestor(int rs, const char *dir)
{
    const uint64_t file_rights = LL_EXECUTE | LL_WRITE_FILE | LL_READ_FILE | LL_TRUNCATE |
                                 LL_IOCTL_DEV;
    const uint64_t dir_only = ll_handled & ~(LL_EXECUTE | LL_WRITE_FILE | LL_READ_FILE |
                                             LL_REFER | LL_TRUNCATE | LL_IOCTL_DEV);
    int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0)
        return errno == ENOENT || errno == ENOTDIR ? 0 : -1;
    if (ll_add(rs, dfd, dir_only) < 0) {
        close(dfd);
        return -1;
    }
    DIR *d = fdopendir(dfd);
    if (!d) {
        close(dfd);
        return -1;
    }
    char full[4096];
    struct dirent *e;
    int rc = 0;
    while ((e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
            continue;
        int n = snprintf(full, sizeof full, "%s/%s", strcmp(dir, "/") ? dir : "", e->d_name);
        if (n < 0 || (size_t)n >= sizeof full || ll_is_denied(full) || ll_is_ancestor(full))
            continue;
        int fd = openat(dfd, e->d_name, O_PATH | O_NOFOLLOW | O_CLOEXEC);
        struct stat st;
        if (fd < 0)
            continue; /* vanished meanwhile: no access is the safe side */
        if (fstat(fd, &st) == 0 && !S_ISLNK(st.st_mode)) /* a link's target has its own rule */
            rc = ll_add(rs, fd, S_ISDIR(st.st_mode) ? ll_handled : file_rights);
        close(fd);
        if (rc < 0)
            break;
    }
    closedir(d);
    return rc;
}

/* A ruleset fd for the next command (-2: Landlock off; -1 with errno: failure). */
static int landlock_ruleset(void)
{
    if (!ll_handled)
        return -2;
    struct ll_ruleset_attr attr = {ll_handled};
    int rs = (int)syscall(SYS_landlock_create_ruleset, &attr, sizeof attr, 0);
    if (rs < 0)
        return -1;
    /* The platform shell is outside the tree: commands may exec it (only it, by its fd). */
    if (shell_fd >= 0 && ll_add(rs, shell_fd, LL_EXECUTE | LL_READ_FILE) < 0)
        goto fail;
    if (tool_fd >= 0 && ll_add(rs, tool_fd, LL_EXECUTE | LL_READ_FILE) < 0)
        goto fail;
    ll_nact = 0;
    for (int i = 0; i < ll_ndeny; i++)
        if (!ll_is_masked(ll_deny[i]))
            ll_act[ll_nact++] = ll_deny[i];
    if (ll_nact == 0) { /* every hidden path masked: the domain only locks the mount topology */
        int root = open("/", O_PATH | O_CLOEXEC);
        int rc = root < 0 ? -1 : ll_add(rs, root, ll_handled);
        if (root >= 0)
            close(root);
        if (rc < 0)
            goto fail;
        return rs;
    }
    if (ll_add_ancestor(rs, "/") < 0)
        goto fail;
    /* Every proper ancestor of every unmasked hidden path, shallowest first per path. */
    char anc[4096];
    for (int i = 0; i < ll_nact; i++) {
        const char *p = ll_act[i];
        for (const char *slash = strchr(p + 1, '/'); slash; slash = strchr(slash + 1, '/')) {
            size_t n = (size_t)(slash - p);
            if (n >= sizeof anc)
                break;
            memcpy(anc, p, n);
            anc[n] = 0;
            int seen = 0; /* shared with an earlier denied path: already done */
            for (int j = 0; j < i && !seen; j++)
                seen = strncmp(ll_act[j], anc, n) == 0 && ll_act[j][n] == '/';
            if (!seen && ll_add_ancestor(rs, anc) < 0)
                goto fail;
        }
    }
    return rs;
fail:;
    int err = errno;
    close(rs);
    errno = err;
    return -1;
}

static const char *step_names[] = {"unknown", "setsid", "join cgroup", "setgroups", "setgid",
                                   "setuid", "chdir", "open /dev/null", "dup2", "exec",
                                   "landlock", "oom_score_adj", "platform shell",
                                   "platform tool", "chroot", "drop capabilities",
                                   "controlling terminal"};
enum { ST_SETSID = 1, ST_CGROUP, ST_SETGROUPS, ST_SETGID, ST_SETUID, ST_CHDIR, ST_DEVNULL,
       ST_DUP2, ST_EXEC, ST_LANDLOCK, ST_OOM, ST_SHELL, ST_TOOL, ST_CHROOT, ST_CAPS, ST_TTY,
       ST_LAST = ST_TTY };

/* Guest mode: the capabilities a command keeps, even as the guest's root: a container's set
 * (rollbox.backends.container.bundle.CAPABILITIES) without SYS_CHROOT, which in a guest leads
 * out of the sandbox root into the initramfs (its raw layers and the tools' view). Gone with
 * the rest: SYS_ADMIN (unmount or move a hidden path's mask, mount filesystems), SYS_PTRACE
 * (/proc/1/root), DAC_READ_SEARCH (open_by_handle_at past the masks), MKNOD, SYS_MODULE,
 * SYS_RAWIO, NET_RAW, SYS_TIME... Dropped from the bounding set, so root's exec gets no more;
 * a guest booted with rollbox.fullroot=1 (the red team's unhardened twin) keeps them all. */
static const int guest_kept_caps[] = {0 /* CHOWN */, 1 /* DAC_OVERRIDE */, 3 /* FOWNER */,
                                      4 /* FSETID */, 5 /* KILL */, 6 /* SETGID */,
                                      7 /* SETUID */, 8 /* SETPCAP */,
                                      10 /* NET_BIND_SERVICE */, 31 /* SETFCAP */};
static int guest_full_root; /* rollbox.fullroot=1 on the kernel command line */

static int drop_guest_caps(void)
{
    for (int cap = 0; cap < 64; cap++) {
        int keep = 0;
        for (size_t i = 0; i < sizeof guest_kept_caps / sizeof guest_kept_caps[0]; i++)
            keep |= guest_kept_caps[i] == cap;
        if (keep)
            continue;
        if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0) {
            if (errno == EINVAL)
                break; /* past the kernel's last capability */
            return -1;
        }
    }
    if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) < 0 && errno != EINVAL)
        return -1;
    struct { uint32_t version; int pid; } hdr = {0x20080522 /* _LINUX_CAPABILITY_VERSION_3 */, 0};
    struct { uint32_t effective, permitted, inheritable; } data[2];
    if (syscall(SYS_capget, &hdr, data) < 0)
        return -1;
    data[0].inheritable = data[1].inheritable = 0;
    return syscall(SYS_capset, &hdr, data) < 0 ? -1 : 0;
}

static void spawn_failed(uint32_t id, int err, const char *msg)
{
    char buf[4 + 240];
    int32_t e = err;
    memcpy(buf, &e, 4);
    size_t len = strnlen(msg, sizeof buf - 4);
    memcpy(buf + 4, msg, len);
    send_small(M_SPAWN_FAILED, id, buf, 4 + len);
}

/* A spawn that failed before the child ran: close what was opened (-1 = not opened), free
 * the session, and report "<step>: <error>". */
static void abandon_spawn(uint32_t id, const char *step, int err, const int *fds, size_t nfds,
                          void *session, void *vec)
{
    for (size_t j = 0; j < nfds; j++)
        if (fds[j] >= 0)
            close(fds[j]);
    free(session);
    free(vec);
    char msg[96];
    snprintf(msg, sizeof msg, "%s: %s", step, strerror(err));
    spawn_failed(id, err, msg);
}

/* EXEC_PLATFORM_TOOL built into the agent (no busybox applet lists xattrs; busybox tar
 * carries none), exec'd from the agent's own binary like an applet (main() dispatches on
 * argv[0]: a spawned child shares the agent's memory until its exec, so it runs nothing
 * itself). `rollbox-xattrs DIR` writes the user.* extended attributes of everything below DIR (DIR
 * included, symlinks never followed, special files have none) to stdout, one record each:
 * "XA", u16 path length, u16 name length, u32 value length (little endian), then the path
 * relative to DIR ("" for DIR), the name and the value. The host parses it as hostile. */
#define XATTR_TOOL "rollbox-xattrs"
#define XATTR_TOOL_DEPTH 256

static int write_all(int fd, const void *buf, size_t n)
{
    const char *p = buf;
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

static int xattr_records(int fd, const char *path, size_t plen, char *names, char *value)
{
    ssize_t n = flistxattr(fd, names, XATTR_LIST_MAX);
    for (char *name = names; n > 0 && name < names + n; name += strlen(name) + 1) {
        if (strncmp(name, "user.", 5) != 0)
            continue;
        ssize_t v = fgetxattr(fd, name, value, XATTR_SIZE_MAX);
        if (v < 0)
            continue; /* removed meanwhile, or grew: the sandbox runs on */
        size_t nl = strlen(name);
        unsigned char hdr[10] = {'X', 'A', plen & 0xff, plen >> 8, nl & 0xff, nl >> 8,
                                 v & 0xff, (v >> 8) & 0xff, (v >> 16) & 0xff, (v >> 24) & 0xff};
        if (write_all(1, hdr, sizeof hdr) < 0 || write_all(1, path, plen) < 0 ||
            write_all(1, name, nl) < 0 || write_all(1, value, (size_t)v) < 0)
            return -1;
    }
    return 0;
}

/* `dfd` (closed here) is the directory at `path` (plen bytes, in a PATH_MAX buffer). */
static int xattr_walk(int dfd, char *path, size_t plen, int depth, char *names, char *value)
{
    if (xattr_records(dfd, path, plen, names, value) < 0) {
        close(dfd);
        return -1;
    }
    DIR *d = fdopendir(dfd);
    if (!d) {
        close(dfd);
        return 0;
    }
    int rc = 0;
    struct dirent *e;
    while (rc == 0 && (e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
            continue;
        size_t nl = strlen(e->d_name);
        if (plen + 1 + nl >= PATH_MAX)
            continue; /* longer than the host takes anyway */
        struct stat st;
        if (fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) < 0 ||
            !(S_ISREG(st.st_mode) || S_ISDIR(st.st_mode)))
            continue;
        if (S_ISDIR(st.st_mode) && depth >= XATTR_TOOL_DEPTH)
            continue;
        int fd = openat(dirfd(d), e->d_name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC |
                        (S_ISDIR(st.st_mode) ? O_DIRECTORY : 0));
        if (fd < 0)
            continue;
        size_t cl = plen;
        if (plen)
            path[cl++] = '/';
        memcpy(path + cl, e->d_name, nl);
        cl += nl;
        if (S_ISDIR(st.st_mode)) {
            rc = xattr_walk(fd, path, cl, depth + 1, names, value);
        } else {
            rc = xattr_records(fd, path, cl, names, value);
            close(fd);
        }
        path[plen] = 0;
    }
    closedir(d);
    return rc;
}

static int xattr_tool(const char *dir)
{
    static char path[PATH_MAX];
    char *names = malloc(XATTR_LIST_MAX), *value = malloc(XATTR_SIZE_MAX);
    int fd = dir ? open(dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC) : -1;
    if (!names || !value || fd < 0) {
        fprintf(stderr, XATTR_TOOL ": can't open '%s': %s\n", dir ? dir : "", strerror(errno));
        return 1;
    }
    if (xattr_walk(fd, path, 0, 0, names, value) < 0) {
        fprintf(stderr, XATTR_TOOL ": write error: %s\n", strerror(errno));
        return 1;
    }
    return 0;
}

/* `rollbox-watch [-r] DIR`, a platform tool built into the agent (exec'd from its own binary,
 * like rollbox-xattrs): an inotify watch of DIR (and, with -r, of every directory below it, new
 * ones added as they appear), run inside the sandbox (its root: every path resolves there, with
 * no symlink or magic link followed below DIR). It writes one record per inotify event to
 * stdout: 'W', 'E', u32 mask, u32 cookie, u16 path length (little endian), then the path relative
 * to DIR ("" for DIR itself). Each byte it reads on stdin is a barrier: it drains what inotify
 * has queued (every event of a syscall that returned before the byte was sent) and answers 'W',
 * 'S' and ten zero bytes. The kernel bounds the queue (IN_Q_OVERFLOW is passed on as an event);
 * a full stdout pipe stalls the tool, not the agent. It exits 0 when DIR goes away (after its
 * IN_DELETE_SELF / IN_MOVE_SELF / IN_IGNORED; a removal, whose IN_DELETE_SELF the kernel holds
 * back while the tool has DIR open, is seen by DIR's link count within WATCH_GONE_CHECK_MS and
 * reported as that IN_DELETE_SELF) or at stdin's end, 1 if DIR can not be watched.
 * The host parses the records as hostile. */
#define WATCH_TOOL "rollbox-watch"
#define WATCH_MAX_DIRS 8192
#define WATCH_DEPTH 64
#define WATCH_GONE_CHECK_MS 1000
#define WATCH_MASK (IN_CREATE | IN_MODIFY | IN_ATTRIB | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO | \
                    IN_DELETE_SELF | IN_MOVE_SELF)
#ifndef RESOLVE_NO_MAGICLINKS
#define RESOLVE_NO_MAGICLINKS 0x02
#define RESOLVE_NO_SYMLINKS 0x04
#define RESOLVE_BENEATH 0x08
#endif
struct watch_open_how { uint64_t flags, mode, resolve; };

static struct { int wd; char *path; } watch_dirs[WATCH_MAX_DIRS];
static int watch_ndirs, watch_ifd = -1, watch_root_fd = -1;

static int watch_record(char kind, uint32_t mask, uint32_t cookie, const char *path, size_t pl)
{
    if (pl > 0xffff)
        pl = 0xffff;
    unsigned char h[12] = {'W', (unsigned char)kind,
                           mask & 0xff, (mask >> 8) & 0xff, (mask >> 16) & 0xff, mask >> 24,
                           cookie & 0xff, (cookie >> 8) & 0xff, (cookie >> 16) & 0xff, cookie >> 24,
                           pl & 0xff, pl >> 8};
    return write_all(1, h, sizeof h) < 0 || (pl && write_all(1, path, pl) < 0) ? -1 : 0;
}

/* Watch the directory `rel` below DIR ("" for DIR): opened beneath DIR with no symlink
 * followed, watched through "." after a fchdir (inotify_add_watch would follow a path). */
static int watch_add(const char *rel, int depth, int recursive)
{
    if (watch_ndirs >= WATCH_MAX_DIRS) {
        fprintf(stderr, WATCH_TOOL ": more than %d directories, not all watched\n",
                WATCH_MAX_DIRS);
        return 0;
    }
    int fd = dup(watch_root_fd);
    if (*rel) {
        struct watch_open_how how = {O_RDONLY | O_DIRECTORY | O_CLOEXEC, 0,
                                     RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS |
                                     RESOLVE_NO_MAGICLINKS};
        close(fd);
        fd = (int)syscall(SYS_openat2, watch_root_fd, rel, &how, sizeof how);
    }
    if (fd < 0 || fchdir(fd) < 0) {
        if (fd >= 0)
            close(fd);
        return 0; /* gone or replaced meanwhile: the sandbox runs on */
    }
    int wd = inotify_add_watch(watch_ifd, ".", WATCH_MASK | IN_ONLYDIR | IN_DONT_FOLLOW);
    if (wd < 0) {
        close(fd);
        return *rel ? 0 : -1;
    }
    int known = 0;
    for (int i = 0; i < watch_ndirs; i++)
        if (watch_dirs[i].wd == wd)
            known = 1;
    if (!known) {
        watch_dirs[watch_ndirs].wd = wd;
        watch_dirs[watch_ndirs].path = strdup(rel);
        watch_ndirs++;
    }
    if (!recursive || depth >= WATCH_DEPTH) {
        close(fd);
        return 0;
    }
    DIR *d = fdopendir(fd);
    if (!d) {
        close(fd);
        return 0;
    }
    size_t rl = strlen(rel);
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_type != DT_DIR || !strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
            continue;
        size_t nl = strlen(e->d_name);
        if (rl + 1 + nl >= PATH_MAX)
            continue;
        char sub[PATH_MAX];
        snprintf(sub, sizeof sub, "%s%s%s", rel, rl ? "/" : "", e->d_name);
        watch_add(sub, depth + 1, recursive);
    }
    closedir(d);
    return 0;
}

/* Everything inotify has queued now; 1 when DIR itself went away. */
static int watch_drain(int recursive)
{
    static char buf[64 << 10] __attribute__((aligned(8)));
    int gone = 0;
    for (;;) {
        ssize_t n = read(watch_ifd, buf, sizeof buf);
        if (n <= 0)
            return n < 0 && errno != EAGAIN && errno != EINTR ? -1 : gone;
        for (char *p = buf; p < buf + n;) {
            struct inotify_event *ev = (struct inotify_event *)p;
            p += sizeof *ev + ev->len;
            if (ev->mask & IN_Q_OVERFLOW) {
                if (watch_record('E', IN_Q_OVERFLOW, 0, "", 0) < 0)
                    return -1;
                continue;
            }
            const char *dir = NULL;
            for (int i = 0; i < watch_ndirs; i++)
                if (watch_dirs[i].wd == ev->wd)
                    dir = watch_dirs[i].path;
            if (!dir)
                continue;
            int is_root = !*dir;
            if (ev->mask & IN_IGNORED) { /* removed, or its file system went: slot freed */
                if (is_root)
                    gone = 1;
                for (int i = 0; i < watch_ndirs; i++)
                    if (watch_dirs[i].wd == ev->wd && !is_root) {
                        free(watch_dirs[i].path);
                        watch_dirs[i] = watch_dirs[--watch_ndirs];
                        break;
                    }
                continue;
            }
            if (ev->mask & (IN_DELETE_SELF | IN_MOVE_SELF) && !is_root)
                continue; /* its parent reports it */
            char path[PATH_MAX];
            const char *name = ev->len ? ev->name : "";
            int pl = snprintf(path, sizeof path, "%s%s%s", dir, *dir && *name ? "/" : "", name);
            if (pl < 0 || pl >= (int)sizeof path)
                continue;
            if (watch_record('E', ev->mask, ev->cookie, path, (size_t)pl) < 0)
                return -1;
            if (recursive && (ev->mask & IN_ISDIR) && (ev->mask & (IN_CREATE | IN_MOVED_TO)))
                watch_add(path, 1, recursive);
            if (is_root && (ev->mask & (IN_DELETE_SELF | IN_MOVE_SELF)))
                gone = 1;
        }
    }
}

static int watch_tool(int argc, char **argv)
{
    int recursive = argc > 2 && strcmp(argv[1], "-r") == 0;
    const char *dir = argc > 1 ? argv[argc - 1] : NULL;
    if (!dir || argc > 3 || (argc == 3 && !recursive)) {
        fprintf(stderr, "usage: " WATCH_TOOL " [-r] DIR\n");
        return 1;
    }
    struct watch_open_how how = {O_RDONLY | O_DIRECTORY | O_CLOEXEC, 0, RESOLVE_NO_MAGICLINKS};
    watch_root_fd = (int)syscall(SYS_openat2, AT_FDCWD, dir, &how, sizeof how);
    watch_ifd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
    if (watch_root_fd < 0 || watch_ifd < 0 || watch_add("", 0, recursive) < 0) {
        fprintf(stderr, WATCH_TOOL ": can't watch '%s': %s\n", dir, strerror(errno));
        return 1;
    }
    if (watch_record('S', 0, 0, "", 0) < 0) /* watching: the host may go on */
        return 1;
    struct pollfd pf[2] = {{watch_ifd, POLLIN, 0}, {0, POLLIN, 0}};
    for (;;) {
        /* A timeout: DIR removed while we hold it open gets its IN_DELETE_SELF only once the
         * last reference goes, so its link count (0 once removed) is looked at meanwhile. */
        int ready = poll(pf, 2, WATCH_GONE_CHECK_MS);
        if (ready < 0) {
            if (errno == EINTR)
                continue;
            return 1;
        }
        int gone = watch_drain(recursive);
        if (gone < 0)
            return 1;
        if (gone)
            return 0;
        struct stat rs;
        if (fstat(watch_root_fd, &rs) == 0 && rs.st_nlink == 0)
            return watch_record('E', IN_DELETE_SELF, 0, "", 0) < 0 ? 1 : 0;
        if (!ready)
            continue;
        if (pf[1].revents) {
            char b[256];
            ssize_t n = read(0, b, sizeof b);
            if (n <= 0)
                return 0;
            gone = watch_drain(recursive);
            if (gone < 0)
                return 1;
            for (ssize_t i = 0; i < n; i++)
                if (watch_record('S', 0, 0, "", 0) < 0)
                    return 1;
            if (gone)
                return 0;
        }
    }
}

/* `rollbox-xattr get PATH...` and `rollbox-xattr set PATH NAME HEXVALUE...`, a platform tool
 * built into the agent (exec'd from its own binary, like rollbox-xattrs): the user.* extended
 * attributes of named files, for the file API of a sandbox whose files the host never touches
 * (a microVM). Each PATH resolves where the tool runs, no magic link followed on the way and its
 * last component never followed; it is looked at through O_PATH first, so no device or FIFO is
 * ever opened, then opened for its attributes and checked to be the same inode. Only regular
 * files and directories have attributes here (links and special files none, as in hostfs).
 * get: for each PATH (argument i, from 0) up to XF_MAX_ATTRS of its user.* attributes (not
 * user.overlay.*, the overlay's; names of at most XF_MAX_NAME bytes, values of at most
 * XF_MAX_VALUE: the caps hostfs reads with), one record each: 'X', 'G', u32 i, u16 name length,
 * u16 value length (little endian), the name, the value. A PATH that is missing or of another
 * type has none; exit 0. set: PATH must be a regular file; each NAME (user.*, not user.overlay.*,
 * at most XF_MAX_NAME bytes) gets the bytes HEXVALUE spells (at most XF_MAX_VALUE); the first
 * failure ends it with exit 1 and a message naming the errno. The host parses the records as
 * hostile and checks what it sets before it asks. */
#define XATTR_FILE_TOOL "rollbox-xattr"
#define XF_MAX_ATTRS 64
#define XF_MAX_NAME 255
#define XF_MAX_VALUE 4096

static int xf_name_ok(const char *n)
{
    size_t l = strlen(n);
    return l > 5 && l <= XF_MAX_NAME && strncmp(n, "user.", 5) == 0 &&
           strncmp(n, "user.overlay.", 13) != 0;
}

/* PATH opened (read-only, non-blocking) for its attributes; -1 with errno when it is missing,
 * changed meanwhile (EAGAIN), or neither a regular file nor (if `dirs`) a directory (EINVAL). */
static int xf_open(const char *path, int dirs)
{
    struct watch_open_how how = {O_PATH | O_NOFOLLOW | O_CLOEXEC, 0, RESOLVE_NO_MAGICLINKS};
    int pfd = (int)syscall(SYS_openat2, AT_FDCWD, path, &how, sizeof how);
    if (pfd < 0)
        return -1;
    struct stat a, b;
    int st_ok = fstat(pfd, &a) == 0;
    close(pfd);
    if (!st_ok)
        return -1;
    if (!(S_ISREG(a.st_mode) || (dirs && S_ISDIR(a.st_mode)))) {
        errno = S_ISDIR(a.st_mode) ? EISDIR : EINVAL;
        return -1;
    }
    how.flags = O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC |
                (S_ISDIR(a.st_mode) ? O_DIRECTORY : 0);
    int fd = (int)syscall(SYS_openat2, AT_FDCWD, path, &how, sizeof how);
    if (fd < 0)
        return -1;
    if (fstat(fd, &b) < 0 || b.st_dev != a.st_dev || b.st_ino != a.st_ino) {
        close(fd);
        errno = EAGAIN;
        return -1;
    }
    return fd;
}

static int xf_hex(int c)
{
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
}

static int xf_get(int n, char **paths)
{
    static char names[XATTR_LIST_MAX], value[XF_MAX_VALUE];
    for (int i = 0; i < n; i++) {
        int fd = xf_open(paths[i], 1);
        if (fd < 0)
            continue; /* missing, or no attributes here: none */
        ssize_t len = flistxattr(fd, names, sizeof names);
        int count = 0;
        for (char *name = names; len > 0 && name < names + len && count < XF_MAX_ATTRS;
             name += strlen(name) + 1) {
            if (!xf_name_ok(name))
                continue;
            ssize_t v = fgetxattr(fd, name, value, sizeof value);
            if (v < 0)
                continue; /* removed meanwhile, or above the cap (ERANGE): not reported */
            size_t nl = strlen(name);
            uint32_t idx = (uint32_t)i;
            unsigned char hdr[10] = {'X', 'G', idx & 0xff, (idx >> 8) & 0xff, (idx >> 16) & 0xff,
                                     idx >> 24, nl & 0xff, nl >> 8, v & 0xff, (v >> 8) & 0xff};
            if (write_all(1, hdr, sizeof hdr) < 0 || write_all(1, name, nl) < 0 ||
                write_all(1, value, (size_t)v) < 0) {
                fprintf(stderr, XATTR_FILE_TOOL ": write error: %s\n", strerror(errno));
                close(fd);
                return 1;
            }
            count++;
        }
        close(fd);
    }
    return 0;
}

static int xf_set(const char *path, int n, char **pairs)
{
    static unsigned char value[XF_MAX_VALUE];
    if (n % 2) {
        fprintf(stderr, "usage: " XATTR_FILE_TOOL " set PATH [NAME HEXVALUE]...\n");
        return 2;
    }
    int fd = xf_open(path, 0);
    if (fd < 0) {
        fprintf(stderr, XATTR_FILE_TOOL ": can't open '%s': %s\n", path, strerror(errno));
        return 1;
    }
    for (int i = 0; i < n; i += 2) {
        const char *name = pairs[i], *hex = pairs[i + 1];
        size_t hl = strlen(hex), vl = hl / 2;
        int bad = !xf_name_ok(name) || hl % 2 || vl > sizeof value;
        for (size_t j = 0; !bad && j < vl; j++) {
            int hi = xf_hex(hex[2 * j]), lo = xf_hex(hex[2 * j + 1]);
            bad = hi < 0 || lo < 0;
            value[j] = (unsigned char)(hi << 4 | lo);
        }
        if (bad) {
            fprintf(stderr, XATTR_FILE_TOOL ": bad attribute %d: %s\n", i / 2, strerror(EINVAL));
            close(fd);
            return 1;
        }
        if (fsetxattr(fd, name, value, vl, 0) < 0) {
            fprintf(stderr, XATTR_FILE_TOOL ": can't set '%s' on '%s': %s\n", name, path,
                    strerror(errno));
            close(fd);
            return 1;
        }
    }
    close(fd);
    return 0;
}

static int xattr_file_tool(int argc, char **argv)
{
    if (argc >= 2 && strcmp(argv[1], "get") == 0)
        return xf_get(argc - 2, argv + 2);
    if (argc >= 3 && strcmp(argv[1], "set") == 0)
        return xf_set(argv[2], argc - 3, argv + 3);
    fprintf(stderr, "usage: " XATTR_FILE_TOOL " get PATH... | set PATH [NAME HEXVALUE]...\n");
    return 2;
}

/* Runs in the child: never returns. A step that fails leaves (step, errno) in `report`, in
 * the agent's memory (the child shares it until exec). */
static void child_exec(volatile int32_t *report, int in_rd, int out_wr, int err_wr, int cgfd,
                       uid_t uid, gid_t gid, const char *cwd, char **argv, char **envp,
                       uint32_t flags)
{
    sigset_t all;
    sigemptyset(&all);
    sigprocmask(SIG_SETMASK, &all, NULL);
    /* The agent catches no signal and ignores only SIGPIPE (main resets the rest once): the
     * one disposition exec would keep. */
    signal(SIGPIPE, SIG_DFL);
    if (setsid() < 0) {
        report[0] = ST_SETSID;
        goto fail;
    }
    /* The edge may shield the agent from the OOM killer; its commands start from 0 again
     * (raising needs no privilege; they can not go below the floor runc set). */
    int oom = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
    if (oom < 0 || write(oom, "0", 1) != 1) {
        report[0] = ST_OOM;
        goto fail;
    }
    close(oom);
    if (cgfd >= 0) {
        int fd = openat(cgfd, "cgroup.procs", O_WRONLY | O_CLOEXEC);
        if (fd < 0 || write(fd, "0", 1) != 1) {
            report[0] = ST_CGROUP;
            goto fail;
        }
        close(fd);
    }
    /* Built while still sandbox root (enumerating directories a command's user may not list);
     * enforced as the very last step before execve. */
    int ruleset = landlock_ruleset();
    if (ruleset == -1) {
        report[0] = ST_LANDLOCK;
        goto fail;
    }
    /* The view may have no /dev/null of its own: opened before the chroot. */
    if (in_rd < 0) {
        in_rd = open("/dev/null", O_RDONLY | O_CLOEXEC);
        if (in_rd < 0) {
            report[0] = ST_DEVNULL;
            goto fail;
        }
    }
    /* Guest mode: the agent lives in the initramfs; commands see only the sandbox root, the
     * platform's tools only the overlay (TOOL_VIEW). */
    int in_view = (flags & EXEC_PLATFORM_TOOL) && !(flags & EXEC_TOOL_IN_SANDBOX);
    int chroot_fd = in_view && view_fd >= 0 ? view_fd : root_fd;
    if (chroot_fd >= 0 && (fchdir(chroot_fd) < 0 || chroot(".") < 0)) {
        report[0] = ST_CHROOT;
        goto fail;
    }
    if (guest_mode && !guest_full_root && !(flags & EXEC_PLATFORM_TOOL) &&
        drop_guest_caps() < 0) {
        report[0] = ST_CAPS;
        goto fail;
    }
    if (uid != getuid() || gid != getgid()) {
        if (setgroups(0, NULL) < 0) {
            report[0] = ST_SETGROUPS;
            goto fail;
        }
    }
    if (gid != getgid() && setgid(gid) < 0) {
        report[0] = ST_SETGID;
        goto fail;
    }
    if (uid != getuid() && setuid(uid) < 0) {
        report[0] = ST_SETUID;
        goto fail;
    }
    if (chdir(cwd) < 0) {
        report[0] = ST_CHDIR;
        goto fail;
    }
    /* All pipe fds are >= 3 (fds 0-2 are always open in the agent), so dup2 can't clobber. */
    if (dup2(in_rd, 0) < 0 || dup2(out_wr, 1) < 0 || dup2(err_wr, 2) < 0) {
        report[0] = ST_DUP2;
        goto fail;
    }
    /* A pty session: the slave (0-2 now) becomes the controlling terminal of the new session
     * (by descriptor: no path of the sandbox). */
    if ((flags & EXEC_PTY) && ioctl(0, TIOCSCTTY, 0) < 0) {
        report[0] = ST_TTY;
        goto fail;
    }
    /* Everything above 2 goes at exec; the status pipe must survive until then. */
    syscall(SYS_close_range, 3u, ~0u, 4u /* CLOSE_RANGE_CLOEXEC */);
    umask(022);
    if (ruleset >= 0 && syscall(SYS_landlock_restrict_self, ruleset, 0) < 0) {
        report[0] = ST_LANDLOCK;
        goto fail;
    }
    if (flags & (EXEC_PLATFORM_SHELL | EXEC_PLATFORM_TOOL)) {
        /* By descriptor: no path of the sandbox is looked up, so nothing it renamed or
         * replaced runs. The fd is close-on-exec (an ELF binary needs no path to it). The
         * platform's busybox picks its applet from argv[0], the agent its XATTR_TOOL. */
        int fd = (flags & EXEC_PLATFORM_SHELL) ? shell_fd
                 : strcmp(argv[0], XATTR_TOOL) == 0 || strcmp(argv[0], WATCH_TOOL) == 0 ||
                           strcmp(argv[0], XATTR_FILE_TOOL) == 0
                     ? self_fd : tool_fd;
        if (fd < 0)
            errno = EBADF;
        else
            syscall(SYS_execveat, fd, "", argv, envp, AT_EMPTY_PATH);
        report[0] = (flags & EXEC_PLATFORM_SHELL) ? ST_SHELL : ST_TOOL;
        goto fail;
    }
    environ = envp; /* execvpe searches the PATH of `environ`: make it the command's env */
    execvpe(argv[0], argv, envp);
    report[0] = ST_EXEC;
fail:
    report[1] = errno;
    _exit(127);
}

/* The child runs on its own stack in the agent's memory (CLONE_VM | CLONE_VFORK, as
 * posix_spawn does): no page tables copied, no copy-on-write faults in either process (each
 * costly under TCG), and the agent resumes only once the child has exec'd or failed: the
 * outcome is known then, from `report` (as glibc's posix_spawn does). One child at a time, so
 * one stack. The child shares the agent's memory until its exec: child_exec only writes its
 * own stack, `report`, `environ` (restored by the parent) and errno; it calls nothing that
 * takes a lock (the agent has one thread). */
struct spawn_args {
    volatile int32_t report[2]; /* step, errno of a failed step; 0: the exec happened */
    int in_rd, out_wr, err_wr, cgfd;
    uid_t uid;
    gid_t gid;
    const char *cwd;
    char **argv, **envp;
    uint32_t flags;
};
static char spawn_stack[256 << 10] __attribute__((aligned(64)));

static int spawn_child(void *arg)
{
    const struct spawn_args *a = arg;
    child_exec(((struct spawn_args *)arg)->report, a->in_rd, a->out_wr, a->err_wr, a->cgfd, a->uid, a->gid, a->cwd,
               a->argv, a->envp, a->flags);
    return 127;
}

/* clone3 with CLONE_INTO_CGROUP: the child is born in the session's cgroup. Joining it by a
 * write to cgroup.procs instead takes cgroup_threadgroup_rwsem for writing (an RCU grace
 * period): ~11 ms of a ~20 ms exec in a 1-vCPU guest under TCG. glibc has no clone3 wrapper
 * that takes a stack, hence the few instructions below (x86-64; elsewhere, or on a kernel
 * without clone3/CLONE_INTO_CGROUP, the child writes cgroup.procs as before). */
#ifndef CLONE_INTO_CGROUP
#define CLONE_INTO_CGROUP 0x200000000ULL
#endif
#ifndef SYS_clone3
#define SYS_clone3 435
#endif
struct clone3_args {
    uint64_t flags, pidfd, child_tid, parent_tid, exit_signal, stack, stack_size, tls,
        set_tid, set_tid_size, cgroup;
};
static int clone3_cgroup_broken; /* ENOSYS/E2BIG once: an old kernel, don't retry */

#if defined(__x86_64__)
static long clone3_on_stack(struct clone3_args *ca, int (*fn)(void *), void *arg)
{
    /* The child starts after the syscall on the new stack (16-byte aligned top) with the
     * parent's registers; fn and arg ride in callee-saved r12/r13, kept by the syscall. */
    register void *r12 __asm__("r12") = (void *)fn;
    register void *r13 __asm__("r13") = arg;
    long ret;
    __asm__ volatile("syscall\n\t"
                     "test %%rax, %%rax\n\t"
                     "jnz 1f\n\t"
                     "xor %%ebp, %%ebp\n\t"
                     "mov %%r13, %%rdi\n\t"
                     "call *%%r12\n\t"
                     "mov %%eax, %%edi\n\t"
                     "mov $60, %%eax\n\t" /* SYS_exit */
                     "syscall\n\t"
                     "hlt\n\t"
                     "1:\n\t"
                     : "=a"(ret)
                     : "0"((long)SYS_clone3), "D"(ca), "S"(sizeof *ca), "r"(r12), "r"(r13)
                     : "rcx", "r11", "memory");
    return ret;
}
#endif

static pid_t spawn(struct spawn_args *a)
{
    char **saved_environ = environ;
    pid_t pid = -1;
    int err = 0, done = 0;
#if defined(__x86_64__)
    if (a->cgfd >= 0 && !clone3_cgroup_broken) {
        struct clone3_args ca = {
            .flags = CLONE_VM | CLONE_VFORK | CLONE_INTO_CGROUP, .exit_signal = SIGCHLD,
            .stack = (uint64_t)(uintptr_t)spawn_stack, .stack_size = sizeof spawn_stack,
            .cgroup = (uint64_t)a->cgfd};
        int cgfd = a->cgfd;
        a->cgfd = -1; /* the child is in it already: no cgroup.procs write */
        long r = clone3_on_stack(&ca, spawn_child, a);
        a->cgfd = cgfd;
        if (r >= 0) {
            pid = (pid_t)r;
            done = 1;
        } else if (r == -ENOSYS || r == -E2BIG) {
            clone3_cgroup_broken = 1;
            logmsg("clone3 into a cgroup: %s; joining by cgroup.procs", strerror((int)-r));
        } /* else (a cgroup it may not join...): the old way, which reports the step */
    }
#endif
    if (!done) {
        pid = clone(spawn_child, spawn_stack + sizeof spawn_stack,
                    CLONE_VM | CLONE_VFORK | SIGCHLD, (void *)a);
        err = errno;
    }
    environ = saved_environ;
    errno = err;
    return pid;
}

static int set_nonblock(int fd)
{
    int fl = fcntl(fd, F_GETFL);
    return fl < 0 ? -1 : fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

/* Guest mode: a cgroup per session, made by the agent under the guest's cgroup2 root
 * (memory, pids and cpu enabled at boot): timeouts kill through its cgroup.kill, its
 * memory.events tells whether the OOM killer struck. */
static void session_cgroup_path(uint64_t seq, char *buf, size_t n)
{
    snprintf(buf, n, "/sys/fs/cgroup/rollbox/s%llu", (unsigned long long)seq);
}

/* Empty session cgroups kept for reuse: making one (mkdir of a memory cgroup) and removing
 * it cost ~35 ms per command under TCG, against ~10 ms for the rest of an exec. */
#define CG_POOL_MAX 16
#define CG_PREMADE 2 /* made at boot, so a template's clones start with them */
static struct { uint64_t seq; int oom; } cg_pool[CG_POOL_MAX];
static int cg_pool_n;

/* A reused cgroup gets back the defaults a command may have changed in its own cgroup (its
 * limits, its protection from reclaim, its OOM grouping and its CPU share). */
static void reset_session_cgroup(int fd)
{
    static const struct { const char *knob, *value; } knobs[] = {
        {"memory.max", "max"},   {"memory.high", "max"}, {"memory.swap.max", "max"},
        {"memory.min", "0"},     {"memory.low", "0"},    {"memory.oom.group", "0"},
        {"pids.max", "max"},     {"cpu.max", "max"},
        {"cpu.idle", "0"},       {"cpu.weight", "100"}}; /* an idle group takes no weight */
    for (size_t i = 0; i < sizeof knobs / sizeof knobs[0]; i++) {
        int k = openat(fd, knobs[i].knob, O_WRONLY | O_CLOEXEC);
        if (k >= 0) {
            size_t n = strlen(knobs[i].value);
            if (write(k, knobs[i].value, n) != (ssize_t)n)
                logmsg("reset %s: %s", knobs[i].knob, strerror(errno));
            close(k);
        }
    }
}

/* Guest mode: the pids limit's refusals, per session cgroup (inotify on its pids.events: the
 * kernel counts a refused fork in the cgroup of the forking task). A session whose command
 * has ended and whose leftovers still fork into the sandbox's limit is a fork bomb nobody
 * waits on: it is killed whole (cgroup.kill), like a command at its deadline. Without this a
 * bomb under TCG keeps the guest at its limit for minutes after its command exited (a
 * container's collapses within a second); a running command is left to its deadline. */
static int pids_fd = -1;
static struct { int wd; uint64_t seq; } *pids_watches;
static size_t pids_watch_n, pids_watch_cap;

static void watch_session_pids(uint64_t seq, const char *path)
{
    if (pids_fd < 0)
        return;
    char file[128];
    snprintf(file, sizeof file, "%s/pids.events", path);
    int wd = inotify_add_watch(pids_fd, file, IN_MODIFY);
    if (wd < 0) {
        logmsg("watch %s: %s", file, strerror(errno));
        return;
    }
    for (size_t i = 0; i < pids_watch_n; i++)
        if (pids_watches[i].wd == wd) {
            pids_watches[i].seq = seq;
            return;
        }
    if (pids_watch_n == pids_watch_cap) {
        size_t cap = pids_watch_cap ? pids_watch_cap * 2 : 32;
        void *p = realloc(pids_watches, cap * sizeof *pids_watches);
        if (!p) {
            inotify_rm_watch(pids_fd, wd);
            return;
        }
        pids_watches = p;
        pids_watch_cap = cap;
    }
    pids_watches[pids_watch_n].wd = wd;
    pids_watches[pids_watch_n].seq = seq;
    pids_watch_n++;
}

static void kill_leftover_bomb(uint64_t seq)
{
    for (struct session *s = sessions; s; s = s->next)
        if (s->cg_seq == seq && !s->reaped && s->state != S_FAILED)
            return; /* its command still runs: its deadline (or the caller) ends it */
    char path[128];
    session_cgroup_path(seq, path, sizeof path);
    strcat(path, "/cgroup.kill");
    if (write_file(path, "1") < 0 && errno != ENOENT)
        logmsg("%s: %s", path, strerror(errno));
    else
        logmsg("session cgroup s%llu: leftovers hit the pids limit after their command "
               "ended: killed", (unsigned long long)seq);
}

static void pids_events(void)
{
    char buf[4096] __attribute__((aligned(__alignof__(struct inotify_event))));
    ssize_t n;
    while ((n = read(pids_fd, buf, sizeof buf)) > 0) {
        for (char *p = buf; p < buf + n;) {
            struct inotify_event *ev = (struct inotify_event *)p;
            p += sizeof *ev + ev->len;
            for (size_t i = 0; i < pids_watch_n; i++) {
                if (pids_watches[i].wd != ev->wd)
                    continue;
                if (ev->mask & IN_IGNORED) /* the cgroup was removed */
                    pids_watches[i] = pids_watches[--pids_watch_n];
                else
                    kill_leftover_bomb(pids_watches[i].seq);
                break;
            }
        }
    }
}

static int make_session_cgroup(uint64_t *seq, int *oom_base)
{
    char path[96];
    *oom_base = 0;
    if (cg_pool_n > 0) {
        cg_pool_n--;
        *seq = cg_pool[cg_pool_n].seq;
        *oom_base = cg_pool[cg_pool_n].oom;
        session_cgroup_path(*seq, path, sizeof path);
        int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (fd >= 0)
            return fd; /* reset when it was pooled, after its EXITED went out */
        rmdir(path);
    }
    *seq = ++cg_counter;
    session_cgroup_path(*seq, path, sizeof path);
    if (mkdir(path, 0755) < 0 && errno != EEXIST)
        return -1;
    int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) {
        int err = errno;
        rmdir(path);
        errno = err;
    } else {
        watch_session_pids(*seq, path);
    }
    return fd;
}

/* At the session's end: an empty cgroup goes back to the pool (1: kept), else it stays. */
static int pool_session_cgroup(uint64_t seq, int cgfd, int oom_total)
{
    if (!seq || cg_pool_n >= CG_POOL_MAX)
        return 0;
    char buf[256];
    int fd = openat(cgfd, "cgroup.events", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return 0;
    buf[n] = 0;
    if (!strstr(buf, "populated 0"))
        return 0; /* processes left behind (a daemon the command started) */
    reset_session_cgroup(cgfd); /* here, off the next exec's path */
    cg_pool[cg_pool_n].seq = seq;
    cg_pool[cg_pool_n].oom = oom_total;
    cg_pool_n++;
    return 1;
}

/* Make the pool's first cgroups (guest boot). */
static void premake_session_cgroups(void)
{
    for (int i = 0; i < CG_PREMADE; i++) {
        uint64_t seq;
        int base, fd = make_session_cgroup(&seq, &base);
        if (fd < 0) {
            boot_fail(errno, "session cgroup");
            return;
        }
        if (!pool_session_cgroup(seq, fd, 0))
            remove_session_cgroup(seq);
        close(fd);
    }
}

/* Best effort: a cgroup with processes left in it (a daemon the command started) stays. */
static void remove_session_cgroup(uint64_t seq)
{
    if (!seq)
        return;
    char path[96];
    session_cgroup_path(seq, path, sizeof path);
    if (rmdir(path) < 0 && errno != ENOENT && errno != EBUSY)
        logmsg("rmdir %s: %s", path, strerror(errno));
}

/* oom_kill count of a session cgroup (memory.events), 0 if unknown. */
static int cgroup_oom_kills(int cgfd)
{
    int fd = openat(cgfd, "memory.events", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    char buf[512];
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return 0;
    buf[n] = 0;
    const char *k = strstr(buf, "oom_kill ");
    return k ? atoi(k + 9) : 0;
}

/* A pty pair on the sandbox's own devpts: its ptmx is opened without following links,
 * non-blocking (a FIFO the sandbox put there can not stall the agent), and must be a character
 * device on a devpts filesystem; the slave comes from the master (TIOCGPTPEER), not from a
 * path. Returns 0 with *master (non-blocking, CLOEXEC) and *slave (CLOEXEC), else -1/errno. */
static int open_pty(int *master, int *slave, unsigned cols, unsigned rows, uid_t uid)
{
    int m = root_fd >= 0
        ? openat(root_fd, "dev/pts/ptmx", O_RDWR | O_NOCTTY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC)
        : open("/dev/pts/ptmx", O_RDWR | O_NOCTTY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC);
    if (m < 0)
        return -1;
    struct stat st;
    struct statfs sf;
    int unlock = 0;
    if (fstat(m, &st) < 0 || fstatfs(m, &sf) < 0) {
        int err = errno;
        close(m);
        errno = err;
        return -1;
    }
    if (!S_ISCHR(st.st_mode) || sf.f_type != DEVPTS_MAGIC) {
        close(m);
        errno = ENOTTY;
        return -1;
    }
    struct winsize ws = {.ws_row = (unsigned short)rows, .ws_col = (unsigned short)cols};
    int s = -1;
    if (ioctl(m, TIOCSPTLCK, &unlock) < 0 || ioctl(m, TIOCSWINSZ, &ws) < 0 ||
        (s = ioctl(m, TIOCGPTPEER, O_RDWR | O_NOCTTY | O_CLOEXEC)) < 0) {
        int err = errno;
        close(m);
        errno = err;
        return -1;
    }
    if (uid != 0 && fchown(s, uid, (gid_t)-1) < 0)
        logmsg("pty: chown to %u: %s", (unsigned)uid, strerror(errno)); /* it still works */
    *master = m;
    *slave = s;
    return 0;
}

/* EXEC. payload/plen: after the header. cgfd: attached fd or -1 (ownership taken). */
static int handle_exec(uint32_t id, const char *p, size_t plen, int cgfd)
{
    if (plen < EXEC_HEAD_SIZE) {
        if (cgfd >= 0)
            close(cgfd);
        return -1;
    }
    uint32_t uid = get_u32(p), gid = get_u32(p + 4), timeout_ms = get_u32(p + 8);
    uint32_t flags = get_u32(p + 12);
    uint64_t stream_limit = get_u64(p + 16);
    uint32_t tail_limit = get_u32(p + 24), argc = get_u32(p + 28), envc = get_u32(p + 32);
    const char *str = p + EXEC_HEAD_SIZE, *end = p + plen;
    unsigned pty_cols = 0, pty_rows = 0;
    if (flags & EXEC_PTY) {
        if (plen < EXEC_HEAD_SIZE + PTY_SIZE_LEN) {
            if (cgfd >= 0)
                close(cgfd);
            return -1;
        }
        pty_cols = (unsigned char)str[0] | (unsigned)(unsigned char)str[1] << 8;
        pty_rows = (unsigned char)str[2] | (unsigned)(unsigned char)str[3] << 8;
        str += PTY_SIZE_LEN;
    }
    size_t nstr = 1 + (size_t)argc + (size_t)envc;
    if (argc == 0 || argc > 65536 || envc > 65536) {
        if (cgfd >= 0)
            close(cgfd);
        spawn_failed(id, EINVAL, "argv must have 1 to 65536 entries and env at most 65536");
        return 0;
    }
    char **vec = calloc(nstr + 2, sizeof(char *)); /* cwd, argv..., NULL, env..., NULL */
    if (!vec) {
        if (cgfd >= 0)
            close(cgfd);
        spawn_failed(id, ENOMEM, "out of memory");
        return 0;
    }
    /* Strings are NUL-terminated inside the packet; validate, then point at them in place
     * (the receive buffer is stable until we return, and fork copies it). */
    size_t k = 0;
    for (size_t j = 0; j < nstr; j++) {
        const char *z = memchr(str, 0, (size_t)(end - str));
        if (!z) {
            free(vec);
            if (cgfd >= 0)
                close(cgfd);
            return -1;
        }
        vec[k++] = (char *)str;
        if (j == argc) /* after cwd + argc strings: terminate argv */
            vec[k++] = NULL;
        str = z + 1;
    }
    vec[k] = NULL;
    char *cwd = vec[0], **argv = vec + 1, **envp = vec + 2 + argc;

    if (flags & ~EXEC_KNOWN_FLAGS) {
        free(vec);
        if (cgfd >= 0)
            close(cgfd);
        spawn_failed(id, EINVAL, "unknown EXEC flags");
        return 0;
    }
    if ((flags & EXEC_PLATFORM_SHELL) && (flags & EXEC_PLATFORM_TOOL)) {
        free(vec);
        if (cgfd >= 0)
            close(cgfd);
        spawn_failed(id, EINVAL, "EXEC_PLATFORM_SHELL and EXEC_PLATFORM_TOOL exclude each other");
        return 0;
    }
    if ((flags & EXEC_PTY) && ((flags & (EXEC_PLATFORM_TOOL | EXEC_STDIN)) ||
                               pty_cols < 1 || pty_cols > PTY_MAX_SIZE || pty_rows < 1 ||
                               pty_rows > PTY_MAX_SIZE)) {
        free(vec);
        if (cgfd >= 0)
            close(cgfd);
        spawn_failed(id, EINVAL, "EXEC_PTY: cols and rows 1..1000, no EXEC_STDIN or "
                     "EXEC_PLATFORM_TOOL");
        return 0;
    }
    if ((flags & EXEC_PTY_STDERR) && !(flags & EXEC_PTY)) {
        free(vec);
        if (cgfd >= 0)
            close(cgfd);
        spawn_failed(id, EINVAL, "EXEC_PTY_STDERR needs EXEC_PTY");
        return 0;
    }
    if ((flags & EXEC_TOOL_IN_SANDBOX) && !(flags & EXEC_PLATFORM_TOOL)) {
        free(vec);
        if (cgfd >= 0)
            close(cgfd);
        spawn_failed(id, EINVAL, "EXEC_TOOL_IN_SANDBOX needs EXEC_PLATFORM_TOOL");
        return 0;
    }
    if (((flags & EXEC_CGROUP) != 0) != (cgfd >= 0)) {
        free(vec);
        if (cgfd >= 0)
            close(cgfd);
        spawn_failed(id, EINVAL, "EXEC_CGROUP flag and attached fd disagree");
        return 0;
    }
    if (find_session(id)) {
        free(vec);
        if (cgfd >= 0)
            close(cgfd);
        spawn_failed(id, EEXIST, "session id already in use");
        return 0;
    }
    if (session_count >= MAX_SESSIONS) {
        free(vec);
        if (cgfd >= 0)
            close(cgfd);
        spawn_failed(id, EAGAIN, "too many sessions in this sandbox");
        return 0;
    }
    if (guest_mode && root_fd < 0) {
        /* Never run a command in the initramfs (the agent's own root). */
        free(vec);
        if (cgfd >= 0)
            close(cgfd);
        char msg[BOOT_ERR_MAX + 40];
        snprintf(msg, sizeof msg, "no sandbox root (boot failed: %s)", boot_err);
        spawn_failed(id, boot_errno ? boot_errno : ENOENT, msg);
        return 0;
    }
    uint64_t cg_seq = 0;
    int cg_oom_base = 0;
    if (guest_mode && cgfd < 0) {
        cgfd = make_session_cgroup(&cg_seq, &cg_oom_base);
        if (cgfd < 0) {
            free(vec);
            char msg[96];
            snprintf(msg, sizeof msg, "session cgroup: %s", strerror(errno));
            spawn_failed(id, errno, msg);
            return 0;
        }
    }
    struct session *s = calloc(1, sizeof *s);
    int o[2] = {-1, -1}, e[2] = {-1, -1}, in[2] = {-1, -1};
    if (s && (flags & EXEC_PTY)) {
        /* o[0] the master, in[1] a dup of it (its own epoll watch), o[1] the slave */
        if (open_pty(&o[0], &o[1], pty_cols, pty_rows, uid) < 0 ||
            (in[1] = fcntl(o[0], F_DUPFD_CLOEXEC, 3)) < 0 ||
            ((flags & EXEC_PTY_STDERR) && pipe2(e, O_CLOEXEC) < 0)) {
            int fds[] = {o[0], o[1], in[1], e[0], e[1], cgfd};
            abandon_spawn(id, "pty", errno, fds, sizeof fds / sizeof fds[0], s, vec);
            remove_session_cgroup(cg_seq);
            return 0;
        }
    } else if (!s || pipe2(o, O_CLOEXEC) < 0 || pipe2(e, O_CLOEXEC) < 0 ||
               ((flags & EXEC_STDIN) && pipe2(in, O_CLOEXEC) < 0)) {
        int fds[] = {o[0], o[1], e[0], e[1], in[0], in[1], cgfd};
        abandon_spawn(id, "pipe", errno, fds, sizeof fds / sizeof fds[0], s, vec);
        remove_session_cgroup(cg_seq);
        return 0;
    }
    int is_pty = (flags & EXEC_PTY) != 0;
    struct spawn_args sa = {{0, 0}, is_pty ? o[1] : in[0], o[1], e[1] >= 0 ? e[1] : o[1], cgfd,
                            uid, gid, cwd, argv, envp, flags};
    pid_t pid = spawn(&sa);
    int fork_err = errno;
    close(o[1]);
    if (e[1] >= 0)
        close(e[1]);
    if (in[0] >= 0)
        close(in[0]);
    if (pid < 0) {
        int fds[] = {o[0], e[0], in[1], cgfd};
        abandon_spawn(id, "fork", fork_err, fds, sizeof fds / sizeof fds[0], s, vec);
        remove_session_cgroup(cg_seq);
        return 0;
    }
    s->id = id;
    s->pid = pid;
    s->state = S_SPAWNING;
    s->cgfd = cgfd;
    s->cg_seq = cg_seq;
    s->cg_oom_base = cg_oom_base;
    s->out_fd[0] = o[0];
    s->out_fd[1] = e[0];
    s->in_fd = in[1];
    s->is_pty = is_pty;
    s->stream_limit = stream_limit;
    s->tail_limit = tail_limit < TAIL_LIMIT_MAX ? tail_limit : TAIL_LIMIT_MAX;
    s->deadline_ms = timeout_ms ? now_ms() + timeout_ms : 0;
    s->w_out = (struct watch){W_OUT, s};
    s->w_err = (struct watch){W_ERR, s};
    s->w_in = (struct watch){W_IN, s};
    set_nonblock(s->out_fd[0]);
    ep_add(s->out_fd[0], EPOLLIN | EPOLLET, &s->w_out);
    if (s->out_fd[1] >= 0) {
        set_nonblock(s->out_fd[1]);
        ep_add(s->out_fd[1], EPOLLIN | EPOLLET, &s->w_err);
    }
    if (s->in_fd >= 0) {
        set_nonblock(s->in_fd);
        ep_add(s->in_fd, EPOLLOUT | EPOLLET, &s->w_in);
    }
    s->next = sessions;
    sessions = s;
    session_count++;
    /* The child has exec'd or failed already (CLONE_VFORK). */
    resolve_spawn(s, sa.report[0], sa.report[1], cwd, argv[0]);
    free(vec);
    return 0;
}

/* STARTED, or SPAWN_FAILED naming the step that failed (the child exits 127; reaped later). */
static void resolve_spawn(struct session *s, int step, int err, const char *cwd,
                          const char *argv0)
{
    if (step) {
        step = step > 0 && step <= ST_LAST ? step : 0;
        char msg[512];
        const char *arg = step == ST_CHDIR ? cwd : step == ST_EXEC ? argv0 : NULL;
        snprintf(msg, sizeof msg, "%s%s%.200s: %s", step_names[step], arg ? " " : "",
                 arg ? arg : "", strerror(err));
        spawn_failed(s->id, err, msg);
        s->state = S_FAILED;
        close_watched(&s->out_fd[0]);
        close_watched(&s->out_fd[1]);
        close_watched(&s->in_fd);
        return;
    }
    s->state = S_RUNNING;
    int32_t pid = s->pid;
    send_small(M_STARTED, s->id, &pid, 4);
}

/* ---------- requests ---------- */

/* SESSIONS: every session a (re)connected edge can take over: spawning or running ones and
 * exited ones not yet collected. */
static void handle_list(uint32_t id)
{
    size_t count = 0, cap = (MAX_PACKET - HDR - 4) / SESSION_ENTRY_SIZE;
    for (struct session *s = sessions; s; s = s->next)
        if (s->state != S_FAILED)
            count++;
    if (count > cap)
        count = cap;
    size_t len = HDR + 4 + count * SESSION_ENTRY_SIZE;
    char *buf = malloc(len);
    if (!buf)
        return;
    set_header(buf, M_SESSIONS, id);
    put_u32(buf + HDR, (uint32_t)count);
    size_t k = 0;
    for (struct session *s = sessions; s && k < count; s = s->next) {
        if (s->state == S_FAILED)
            continue;
        char *e = buf + HDR + 4 + k * SESSION_ENTRY_SIZE;
        memset(e, 0, SESSION_ENTRY_SIZE);
        int32_t pid = s->pid, code = 0, sig = 0;
        put_u32(e, s->id);
        memcpy(e + 4, &pid, 4);
        e[8] = (char)(s->state == S_EXITED ? 2 : 1);
        e[9] = (char)(s->timed_out ? 1 : 0);
        e[10] = (char)(s->oom_kills > 255 ? 255 : s->oom_kills);
        if (s->state == S_EXITED)
            exit_status(s, &code, &sig);
        memcpy(e + 12, &code, 4);
        memcpy(e + 16, &sig, 4);
        put_u64(e + 20, s->total[0]);
        put_u64(e + 28, s->total[1]);
        put_u64(e + 36, s->tail[0].len);
        put_u64(e + 44, s->tail[1].len);
        k++;
    }
    send_packet(buf, len, 0);
    free(buf);
}

/* REPLAY: the retained bytes of each stream from the requested offsets (as far back as the
 * ring reaches), as REPLAY_OUT/REPLAY_ERR packets carrying their stream offset, then
 * REPLAY_END with the totals at this moment; later output follows as live STDOUT/STDERR.
 * An unknown session gets only REPLAY_END with flags 1. */
static void handle_replay(uint32_t id, const char *p, size_t plen)
{
    struct session *s = find_session(id);
    char end[HDR + 16];
    set_header(end, M_REPLAY_END, id);
    if (!s || s->state == S_FAILED || plen < 16 || ensure_rdbuf() < 0) {
        end[1] = 1;
        memset(end + HDR, 0, 16);
        send_packet(end, sizeof end, 0);
        return;
    }
    for (int i = 0; i < 2; i++) {
        struct ring *r = &s->tail[i];
        uint64_t from = get_u64(p + 8 * i), first = s->total[i] - r->len;
        /* From here on this connection has every byte from `from` but those the ring no
         * longer holds: only they (and later output past stream_limit) count as dropped, so
         * EXITED and TAIL_* describe what this connection missed, not an earlier one's. */
        s->dropped[i] = from < first ? first - from : 0;
        if (from < first)
            from = first;
        while (from < s->total[i]) {
            size_t n = s->total[i] - from < CHUNK - 8 ? (size_t)(s->total[i] - from) : CHUNK - 8;
            set_header(rdbuf, i == 0 ? M_REPLAY_OUT : M_REPLAY_ERR, id);
            put_u64(rdbuf + HDR, from);
            ring_copy(r, (size_t)(from - first), rdbuf + HDR + 8, n);
            send_packet(rdbuf, HDR + 8 + n, 0);
            from += n;
        }
    }
    put_u64(end + HDR, s->total[0]);
    put_u64(end + HDR + 8, s->total[1]);
    send_packet(end, sizeof end, 0);
}

/* RESULT of a platform command: errno (0: done) and what failed. Returns 0. */
static int send_result(uint32_t id, int err, const char *what)
{
    char buf[4 + 160];
    int32_t e = err;
    memcpy(buf, &e, 4);
    int n = err ? snprintf(buf + 4, sizeof buf - 4, "%s: %s", what, strerror(err)) : 0;
    if (n < 0)
        n = 0;
    if ((size_t)n > sizeof buf - 4)
        n = (int)(sizeof buf - 4);
    send_small(M_RESULT, id, buf, 4 + (size_t)n);
    return 0;
}

/* RESEED: mix host bytes into the kernel's pool, credited, and reseed the CRNG at once (a
 * restored template's clones must not share their RNG state). */
static int handle_reseed(uint32_t id, const char *p, size_t plen)
{
    if (plen == 0 || plen > 4096)
        return send_result(id, EINVAL, "reseed: 1 to 4096 bytes");
    struct rand_pool_info *info = malloc(sizeof *info + plen);
    if (!info)
        return send_result(id, ENOMEM, "reseed");
    info->entropy_count = (int)(plen * 8);
    info->buf_size = (int)plen;
    memcpy(info->buf, p, plen);
    int err = 0;
    int fd = open("/dev/urandom", O_WRONLY | O_CLOEXEC);
    if (fd < 0 || ioctl(fd, RNDADDENTROPY, info) < 0 || ioctl(fd, RNDRESEEDCRNG) < 0)
        err = errno;
    if (fd >= 0)
        close(fd);
    free(info);
    return send_result(id, err, "reseed");
}

/* SET_MACHINE_ID: 32 lowercase hex digits into the sandbox root's /etc/machine-id (written
 * in place of whatever is there; a link there is not followed). */
static int handle_machine_id(uint32_t id, const char *p, size_t plen)
{
    int hex = plen == 32;
    for (size_t j = 0; hex && j < plen; j++)
        hex = (p[j] >= '0' && p[j] <= '9') || (p[j] >= 'a' && p[j] <= 'f');
    if (!hex)
        return send_result(id, EINVAL, "machine-id: 32 lowercase hex digits");
    int base = root_fd >= 0 ? root_fd : AT_FDCWD;
    int etc = openat(base, root_fd >= 0 ? "etc" : "/etc",
                     O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (etc < 0)
        return send_result(id, errno, "open /etc");
    char line[33];
    memcpy(line, p, 32);
    line[32] = '\n';
    /* A regular file of one link (a template's, written at its build): rewritten in place,
     * ~10x cheaper under TCG than a create and rename in the overlay (restore path). */
    int fd = openat(etc, "machine-id", O_WRONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    struct stat st;
    if (fd >= 0 && fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_nlink == 1 &&
        pwrite(fd, line, sizeof line, 0) == (ssize_t)sizeof line &&
        ftruncate(fd, sizeof line) == 0) {
        close(fd);
        close(etc);
        return send_result(id, 0, "write /etc/machine-id");
    }
    if (fd >= 0)
        close(fd);
    unlinkat(etc, "machine-id.rollbox", 0);
    int err = 0;
    fd = openat(etc, "machine-id.rollbox", O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW |
                O_CLOEXEC, 0444);
    if (fd < 0 || write(fd, line, sizeof line) != (ssize_t)sizeof line ||
        renameat(etc, "machine-id.rollbox", etc, "machine-id") < 0)
        err = errno;
    if (fd >= 0)
        close(fd);
    if (err)
        unlinkat(etc, "machine-id.rollbox", 0);
    close(etc);
    return send_result(id, err, "write /etc/machine-id");
}

static uint64_t boottime_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_BOOTTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* BOOT_INFO_REPLY: <iQQQQQQ errno of the failed boot step (0: none), CLOCK_BOOTTIME ns at
 * init start, modules loaded, disks found, mounts done, serving, now; then the message. */
static void handle_boot_info(uint32_t id)
{
    char buf[HDR + 52 + BOOT_ERR_MAX];
    set_header(buf, M_BOOT_INFO_REPLY, id);
    int32_t e = boot_errno;
    memcpy(buf + HDR, &e, 4);
    uint64_t t[6] = {t_init, t_modules, t_disks, t_mounts, t_ready, boottime_ns()};
    for (int i = 0; i < 6; i++)
        put_u64(buf + HDR + 4 + 8 * i, t[i]);
    size_t n = strnlen(boot_err, BOOT_ERR_MAX);
    memcpy(buf + HDR + 52, boot_err, n);
    send_packet(buf, HDR + 52 + n, 0);
}

/* Returns -1 on a malformed packet (the caller drops the connection). */
static int handle_packet(const char *pkt, size_t len, int fd)
{
    if (len < HDR) {
        if (fd >= 0)
            close(fd);
        return -1;
    }
    int type = (unsigned char)pkt[0];
    uint32_t id = get_u32(pkt + 4);
    const char *p = pkt + HDR;
    size_t plen = len - HDR;
    if (type == M_EXEC)
        return handle_exec(id, p, plen, fd);
    /* The platform commands are the guest's (a container's agent is no machine's init: its
     * clock, RNG and names are the host's or runc's), BOOT_INFO the stream transports'; on a
     * container's socket they stay unknown types, as before they existed. */
    if (((type >= M_RESEED && type <= M_SET_CLOCK) && !guest_mode) ||
        (type == M_BOOT_INFO && !stream_mode)) {
        if (fd >= 0)
            close(fd);
        logmsg("packet type %d is not served on this transport", type);
        return -1;
    }
    if (fd >= 0)
        close(fd); /* fds are only expected with EXEC */
    struct session *s = find_session(id);
    switch (type) {
    case M_STDIN:
        if (!s || s->in_fd < 0 || s->in_close_pending) {
            send_stdin_ack(id, plen); /* nobody will read it: give the credit back */
            return 0;
        }
        if (s->in_len + plen > STDIN_BACKLOG_MAX) {
            logmsg("session %u: edge overran the stdin window", id);
            return -1;
        }
        if (plen) {
            char *nb = realloc(s->in_buf, s->in_len + plen);
            if (!nb) {
                send_stdin_ack(id, plen);
                return 0;
            }
            s->in_buf = nb;
            memcpy(s->in_buf + s->in_len, p, plen);
            s->in_len += plen;
            s->in_ready = 1; /* try now; EAGAIN clears it until EPOLLOUT */
            pump_stdin(s);
        }
        return 0;
    case M_STDIN_CLOSE:
        if (s && s->in_fd >= 0) {
            s->in_close_pending = 1;
            pump_stdin(s);
        }
        return 0;
    case M_SIGNAL:
        if (plen < 4)
            return -1;
        {
            int32_t sig;
            memcpy(&sig, p, 4);
            if (sig <= 0 || sig >= NSIG)
                return 0;
            if (s && s->pid > 0 && !s->reaped)
                kill(-s->pid, sig);
        }
        return 0;
    case M_KILL:
        if (s)
            kill_session(s);
        return 0;
    case M_RESIZE:
        if (plen != PTY_SIZE_LEN)
            return -1;
        {
            unsigned cols = (unsigned char)p[0] | (unsigned)(unsigned char)p[1] << 8;
            unsigned rows = (unsigned char)p[2] | (unsigned)(unsigned char)p[3] << 8;
            int fd = s && s->is_pty ? (s->out_fd[0] >= 0 ? s->out_fd[0] : s->in_fd) : -1;
            if (cols < 1 || cols > PTY_MAX_SIZE || rows < 1 || rows > PTY_MAX_SIZE) {
                logmsg("session %u: resize to %ux%u refused (1..%d)", id, cols, rows,
                       PTY_MAX_SIZE);
                return 0;
            }
            struct winsize ws = {.ws_row = (unsigned short)rows, .ws_col = (unsigned short)cols};
            /* the kernel sends SIGWINCH to the terminal's foreground process group */
            if (fd >= 0 && ioctl(fd, TIOCSWINSZ, &ws) < 0)
                logmsg("session %u: TIOCSWINSZ: %s", id, strerror(errno));
        }
        return 0;
    case M_PING:
        send_small(M_PONG, id, NULL, 0);
        return 0;
    case M_LIST:
        handle_list(id);
        return 0;
    case M_REPLAY:
        handle_replay(id, p, plen);
        return 0;
    case M_COLLECT:
        if (s && s->state == S_EXITED)
            free_session(s);
        return 0;
    case M_RESEED:
        return handle_reseed(id, p, plen);
    case M_SET_MACHINE_ID:
        return handle_machine_id(id, p, plen);
    case M_SET_HOSTNAME:
        if (plen == 0 || plen > 64 || memchr(p, 0, plen) || memchr(p, '/', plen))
            return send_result(id, EINVAL, "hostname: 1 to 64 bytes, no NUL or '/'");
        return send_result(id, sethostname(p, plen) < 0 ? errno : 0, "sethostname");
    case M_SET_CLOCK:
        if (plen != 12)
            return -1;
        {
            struct timespec ts;
            int64_t sec;
            memcpy(&sec, p, 8);
            ts.tv_sec = (time_t)sec;
            ts.tv_nsec = (long)get_u32(p + 8);
            if (ts.tv_nsec >= 1000000000L || sec < 0)
                return send_result(id, EINVAL, "clock: bad timespec");
            return send_result(id, clock_settime(CLOCK_REALTIME, &ts) < 0 ? errno : 0,
                               "clock_settime");
        }
    case M_BOOT_INFO:
        handle_boot_info(id);
        return 0;
    case M_SUDO:
        return handle_sudo_enable(id, p, plen);
    default:
        logmsg("unknown packet type %d", type);
        return -1;
    }
}

/* ---------- agent-mediated sudo ----------
 * Privilege raising without setuid: every command runs with no_new_privs, so a setuid sudo can
 * never raise anything. An image that declares it (image config label rollbox.sudo = the uids
 * allowed) makes the edge send SUDO(18) with those uids; only then does the agent listen on
 * SUDO_SOCK (a SOCK_SEQPACKET socket in the sandbox's /dev, the platform's tmpfs: never in a
 * snapshot or fork's files). The image's /usr/bin/sudo (a client the platform ships in the
 * image's read-only layers) connects, the agent authenticates it by SO_PEERCRED (uid 0 or an
 * allowed uid; anyone else is refused before reading a byte), reads one request
 *   SUDO_MAGIC, <IIII uid, gid, argc, envc, then NUL-terminated cwd, argv[argc], env[envc],
 *   with exactly three descriptors (SCM_RIGHTS): the command's stdin, stdout, stderr,
 * and spawns argv exactly as an EXEC of the caller's session (child_exec: that session's cgroup,
 * Landlock, the same caps as a root exec, no_new_privs and seccomp inherited) as uid:gid. Then
 * the client may send <i signal numbers (delivered to the command's process group) and the
 * agent answers once, <ii kind (0 exited, 1 killed by a signal, 2 refused), value (exit code,
 * signal, errno), then a message for a refusal, and closes. Everything on this socket is
 * written by untrusted sandbox code: bounded sizes, every descriptor received closed on every
 * path, a bad packet only closes that connection. */
#define SUDO_SOCK "rollbox-sudo.sock" /* in the sandbox's /dev */
#define SUDO_MAGIC "rbsudo1"          /* 8 bytes with its NUL */
#define SUDO_MAGIC_LEN 8
#define SUDO_HEAD (SUDO_MAGIC_LEN + 16)
#define SUDO_UIDS_MAX 16
#define SUDO_CONNS_MAX 32
#define SUDO_REQ_MAX (64u << 10)
#define SUDO_FDS_MAX 8
#define SUDO_ARGS_MAX 4096
#define TMPFS_MAGIC_ 0x01021994

struct sudo_conn {
    int fd;       /* -1: a free slot */
    pid_t pid;    /* the command, once spawned (0: waiting for the request) */
    struct watch w;
};
static struct sudo_conn sudo_conns[SUDO_CONNS_MAX];
static int sudo_listen_fd = -1;
static uint32_t sudo_uids[SUDO_UIDS_MAX];
static size_t sudo_nuids;
static struct watch w_sudo_listen = {W_SUDO_LISTEN, NULL};

static void sudo_reply(int fd, int32_t kind, int32_t value, const char *msg)
{
    char buf[8 + 256];
    size_t n = msg ? strnlen(msg, 255) : 0;
    memcpy(buf, &kind, 4);
    memcpy(buf + 4, &value, 4);
    if (n)
        memcpy(buf + 8, msg, n);
    if (send(fd, buf, 8 + n, MSG_NOSIGNAL | MSG_DONTWAIT) < 0)
        logmsg("sudo: reply: %s", strerror(errno));
}

/* The slot of a W_SUDO_CONN watch (embedded in its sudo_conn). */
static int sudo_slot(const struct watch *w)
{
    for (int i = 0; i < SUDO_CONNS_MAX; i++)
        if (&sudo_conns[i].w == w)
            return i;
    return -1;
}

static void sudo_close(int i)
{
    if (sudo_conns[i].fd >= 0) {
        epoll_ctl(ep, EPOLL_CTL_DEL, sudo_conns[i].fd, NULL);
        close(sudo_conns[i].fd);
    }
    sudo_conns[i].fd = -1;
    sudo_conns[i].pid = 0;
}

/* The command exited: the one answer, then the connection goes. A command whose client went
 * away is reaped here all the same (0: not a sudo command). */
static int sudo_reaped(pid_t pid, int status)
{
    for (int i = 0; i < SUDO_CONNS_MAX; i++) {
        if (sudo_conns[i].fd < 0 || sudo_conns[i].pid != pid)
            continue;
        if (WIFSIGNALED(status))
            sudo_reply(sudo_conns[i].fd, 1, WTERMSIG(status), NULL);
        else
            sudo_reply(sudo_conns[i].fd, 0, WEXITSTATUS(status), NULL);
        sudo_close(i);
        return 1;
    }
    return 0;
}

static int sudo_uid_allowed(uid_t uid)
{
    if (uid == 0) /* sandbox root gains nothing */
        return 1;
    for (size_t i = 0; i < sudo_nuids; i++)
        if (sudo_uids[i] == uid)
            return 1;
    return 0;
}

/* Listen on /dev/SUDO_SOCK of the sandbox root: /dev opened without following links and
 * checked to be a tmpfs (the platform's, never a directory of the image or the upper). */
static int sudo_listen(void)
{
    int base = root_fd >= 0 ? root_fd : AT_FDCWD;
    int dev = openat(base, root_fd >= 0 ? "dev" : "/dev",
                     O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (dev < 0)
        return -1;
    struct statfs sf;
    if (fstatfs(dev, &sf) < 0 || sf.f_type != TMPFS_MAGIC_) {
        close(dev);
        errno = ENOTDIR;
        return -1;
    }
    int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    int cwd = open(".", O_PATH | O_DIRECTORY | O_CLOEXEC);
    int err = 0;
    if (s < 0 || cwd < 0) {
        err = errno;
    } else {
        unlinkat(dev, SUDO_SOCK, 0); /* one left by an earlier agent (never follows a link) */
        struct sockaddr_un a = {.sun_family = AF_UNIX};
        memcpy(a.sun_path, SUDO_SOCK, sizeof SUDO_SOCK);
        mode_t old = umask(0111); /* 0666: anyone may connect; SO_PEERCRED decides */
        if (fchdir(dev) < 0 || bind(s, (struct sockaddr *)&a, sizeof a) < 0 ||
            listen(s, 16) < 0)
            err = errno;
        umask(old);
        if (fchdir(cwd) < 0 && !err)
            err = errno;
    }
    if (cwd >= 0)
        close(cwd);
    close(dev);
    if (err) {
        if (s >= 0)
            close(s);
        errno = err;
        return -1;
    }
    return s;
}

static int handle_sudo_enable(uint32_t id, const char *p, size_t plen)
{
    if (plen == 0 || plen % 4 || plen / 4 > SUDO_UIDS_MAX)
        return send_result(id, EINVAL, "sudo: 1 to 16 uids");
    if (guest_mode && root_fd < 0)
        return send_result(id, ENOENT, "sudo: no sandbox root");
    uint32_t uids[SUDO_UIDS_MAX];
    size_t n = plen / 4;
    for (size_t i = 0; i < n; i++) {
        uids[i] = get_u32(p + 4 * i);
        if (uids[i] == (uint32_t)-1)
            return send_result(id, EINVAL, "sudo: uid -1");
    }
    if (sudo_listen_fd < 0) {
        sudo_listen_fd = sudo_listen();
        if (sudo_listen_fd < 0)
            return send_result(id, errno, "sudo: listen on /dev/" SUDO_SOCK);
        for (int i = 0; i < SUDO_CONNS_MAX; i++)
            sudo_conns[i].fd = -1;
        ep_add(sudo_listen_fd, EPOLLIN, &w_sudo_listen);
    }
    memcpy(sudo_uids, uids, n * 4);
    sudo_nuids = n;
    return send_result(id, 0, "sudo");
}

/* Refuse a connection: the reply, then what the caller already sent read and dropped (with
 * any descriptors it passed) before the close. A SEQPACKET socket closed with unread messages
 * sets ECONNRESET on its peer, which the peer's next recv returns instead of the reply that is
 * waiting for it: a refused caller saw "Connection reset by peer", not why. A message sent
 * after this drain can still race the close; the client's request is one sendmsg right after
 * connect, normally queued before the accept. */
static void sudo_refuse(int c, int32_t err, const char *msg)
{
    sudo_reply(c, 2, err, msg);
    for (int k = 0; k < 8; k++) { /* bounded: a caller can not hold the agent here */
        char sink[512];
        union {
            struct cmsghdr h;
            char buf[CMSG_SPACE(sizeof(int) * SUDO_FDS_MAX)];
        } ctl;
        struct iovec iov = {sink, sizeof sink};
        struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.buf,
                            .msg_controllen = sizeof ctl.buf};
        if (recvmsg(c, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC) < 0)
            break; /* nothing more queued (EAGAIN) or gone */
        take_fds(&mh, NULL, 0); /* keeps none: every descriptor closed */
    }
    close(c);
}

static void sudo_accept(void)
{
    for (;;) {
        int c = accept4(sudo_listen_fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (c < 0)
            return; /* EAGAIN, or a connection that went away */
        struct ucred cr;
        socklen_t len = sizeof cr;
        if (getsockopt(c, SOL_SOCKET, SO_PEERCRED, &cr, &len) < 0 || len != sizeof cr) {
            close(c);
            continue;
        }
        if (!sudo_uid_allowed(cr.uid)) {
            char msg[96];
            snprintf(msg, sizeof msg, "uid %u may not sudo in this sandbox", (unsigned)cr.uid);
            sudo_refuse(c, EPERM, msg);
            continue;
        }
        int slot = -1;
        for (int i = 0; i < SUDO_CONNS_MAX && slot < 0; i++)
            if (sudo_conns[i].fd < 0)
                slot = i;
        if (slot < 0) {
            sudo_refuse(c, EAGAIN, "too many sudo commands at once");
            continue;
        }
        sudo_conns[slot].fd = c;
        sudo_conns[slot].pid = 0;
        sudo_conns[slot].w = (struct watch){W_SUDO_CONN, NULL};
        ep_add(c, EPOLLIN, &sudo_conns[slot].w);
    }
}

/* The session a caller belongs to: its own session's leader, else the first ancestor that
 * leads a running session (/proc/PID/stat; a bounded walk). NULL: none (an orphan). */
static pid_t parent_of(pid_t pid)
{
    char path[40], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return -1;
    buf[n] = 0;
    char *rp = strrchr(buf, ')'); /* comm may hold anything but ends at the last ')' */
    int ppid;
    if (!rp || sscanf(rp + 1, " %*c %d", &ppid) != 1)
        return -1;
    return ppid;
}

static struct session *session_of(pid_t pid)
{
    pid_t sid = getsid(pid);
    for (int depth = 0; depth < 256 && pid > 1; depth++) {
        for (struct session *s = sessions; s; s = s->next)
            if (s->state == S_RUNNING && !s->reaped && (s->pid == pid || s->pid == sid))
                return s;
        sid = -1;
        pid = parent_of(pid);
    }
    return NULL;
}

static void sudo_request(int i, const char *buf, size_t n, const int *fds, int nfds,
                         const struct ucred *cr)
{
    int c = sudo_conns[i].fd;
    if (n < SUDO_HEAD || memcmp(buf, SUDO_MAGIC, SUDO_MAGIC_LEN) != 0 || nfds != 3) {
        sudo_reply(c, 2, EINVAL, "malformed sudo request");
        sudo_close(i);
        return;
    }
    uint32_t uid = get_u32(buf + 8), gid = get_u32(buf + 12);
    uint32_t argc = get_u32(buf + 16), envc = get_u32(buf + 20);
    if (argc == 0 || argc > SUDO_ARGS_MAX || envc > SUDO_ARGS_MAX || uid == (uint32_t)-1 ||
        gid == (uint32_t)-1) {
        sudo_reply(c, 2, EINVAL, "sudo request: argv 1..4096, env at most 4096 entries");
        sudo_close(i);
        return;
    }
    size_t nstr = 1 + (size_t)argc + (size_t)envc;
    char **vec = calloc(nstr + 2, sizeof(char *));
    if (!vec) {
        sudo_reply(c, 2, ENOMEM, "out of memory");
        sudo_close(i);
        return;
    }
    const char *str = buf + SUDO_HEAD, *end = buf + n;
    size_t k = 0;
    for (size_t j = 0; j < nstr; j++) {
        const char *z = memchr(str, 0, (size_t)(end - str));
        if (!z) {
            free(vec);
            sudo_reply(c, 2, EINVAL, "sudo request: strings not NUL-terminated");
            sudo_close(i);
            return;
        }
        vec[k++] = (char *)str;
        if (j == argc)
            vec[k++] = NULL;
        str = z + 1;
    }
    vec[k] = NULL;
    char *cwd = vec[0], **argv = vec + 1, **envp = vec + 2 + argc;
    struct session *s = session_of(cr->pid);
    if (!s) {
        free(vec);
        sudo_reply(c, 2, ESRCH, "the caller is in no running command of this sandbox");
        sudo_close(i);
        return;
    }
    struct spawn_args sa = {{0, 0}, fds[0], fds[1], fds[2], s->cgfd, uid, gid, cwd, argv, envp,
                            0};
    pid_t pid = spawn(&sa);
    int err = errno;
    if (pid < 0) {
        sudo_reply(c, 2, err, "fork failed");
        sudo_close(i);
    } else if (sa.report[0]) {
        int step = sa.report[0] > 0 && sa.report[0] <= ST_LAST ? sa.report[0] : 0;
        const char *arg = step == ST_CHDIR ? cwd : step == ST_EXEC ? argv[0] : NULL;
        char msg[256];
        snprintf(msg, sizeof msg, "%s%s%.120s: %s", step_names[step], arg ? " " : "",
                 arg ? arg : "", strerror(sa.report[1]));
        sudo_reply(c, 2, sa.report[1], msg);
        sudo_close(i); /* the child exits 127; reap() finds no owner */
    } else {
        sudo_conns[i].pid = pid;
        logmsg("sudo: uid %u (pid %d, session %u) runs %.80s as %u", (unsigned)cr->uid,
               (int)cr->pid, s->id, argv[0], uid);
    }
    free(vec);
}

static void sudo_conn_event(int i, uint32_t events)
{
    if (i < 0 || i >= SUDO_CONNS_MAX || sudo_conns[i].fd < 0)
        return;
    static char *reqbuf;
    if (!reqbuf && !(reqbuf = malloc(SUDO_REQ_MAX))) {
        sudo_close(i);
        return;
    }
    for (;;) {
        int c = sudo_conns[i].fd;
        union {
            struct cmsghdr h;
            char buf[CMSG_SPACE(sizeof(int) * SUDO_FDS_MAX)];
        } ctl;
        struct iovec iov = {reqbuf, SUDO_REQ_MAX};
        struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.buf,
                            .msg_controllen = sizeof ctl.buf};
        ssize_t n = recvmsg(c, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
        int fds[SUDO_FDS_MAX], nfds = n >= 0 ? take_fds(&mh, fds, SUDO_FDS_MAX) : 0;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            if (events & (EPOLLHUP | EPOLLERR))
                sudo_close(i); /* the client went; its command (if any) runs on */
            return;
        }
        if (n <= 0 || nfds < 0) {
            for (int j = 0; j < nfds; j++)
                close(fds[j]);
            if (n > 0)
                sudo_reply(c, 2, EINVAL, "malformed sudo packet");
            sudo_close(i);
            return;
        }
        if (sudo_conns[i].pid == 0) {
            struct ucred cr;
            socklen_t len = sizeof cr;
            if (getsockopt(c, SOL_SOCKET, SO_PEERCRED, &cr, &len) < 0) {
                for (int j = 0; j < nfds; j++)
                    close(fds[j]);
                sudo_close(i);
                return;
            }
            sudo_request(i, reqbuf, (size_t)n, fds, nfds, &cr);
            for (int j = 0; j < nfds; j++)
                close(fds[j]);
            if (sudo_conns[i].fd < 0)
                return;
            continue;
        }
        /* A running command: <i signal numbers only. */
        for (int j = 0; j < nfds; j++)
            close(fds[j]);
        int32_t sig;
        if (n != 4 || nfds) {
            sudo_close(i);
            return;
        }
        memcpy(&sig, reqbuf, 4);
        if (sig > 0 && sig < NSIG)
            kill(-sudo_conns[i].pid, sig);
    }
}

/* Stream input: scan for HELLO while not LIVE, else take whole frames. Returns 0, or -1
 * when the connection was dropped (the buffer is gone). */
static int parse_stream(void)
{
    size_t off = 0;
    unsigned gen = in_gen;
    while (off < in_have) {
        if (conn_state != C_LIVE) {
            const char *m = memmem(inbuf + off, in_have - off, HELLO_MAGIC, MAGIC_LEN);
            if (!m) { /* keep a possible start of the magic */
                size_t keep = in_have - off < MAGIC_LEN - 1 ? in_have - off : MAGIC_LEN - 1;
                off = in_have - keep;
                break;
            }
            off = (size_t)(m - inbuf);
            if (in_have - off < MAGIC_LEN + NONCE_LEN)
                break;
            on_hello((const unsigned char *)inbuf + off + MAGIC_LEN);
            off += MAGIC_LEN + NONCE_LEN;
            continue;
        }
        if (in_have - off < FRAME_PREFIX)
            break;
        uint32_t len = get_u32(inbuf + off);
        if (len < HDR || len > MAX_PACKET) {
            drop_conn("bad frame length");
            return -1;
        }
        if (in_have - off < FRAME_PREFIX + (size_t)len)
            break;
        const char *pkt = inbuf + off + FRAME_PREFIX;
        off += FRAME_PREFIX + len;
        if ((unsigned char)pkt[0] == M_HELLO) {
            if (len != HDR + MAGIC_LEN + NONCE_LEN || memcmp(pkt + HDR, HELLO_MAGIC, MAGIC_LEN)) {
                drop_conn("malformed HELLO");
                return -1;
            }
            on_hello((const unsigned char *)pkt + HDR + MAGIC_LEN);
            continue;
        }
        if (handle_packet(pkt, len, -1) < 0) {
            drop_conn("malformed packet");
            return -1;
        }
        if (gen != in_gen)
            return -1;
    }
    memmove(inbuf, inbuf + off, in_have - off);
    in_have -= off;
    return 0;
}

static void read_stream(int hangup)
{
    if (!inbuf && !(inbuf = malloc(STREAM_IN_CAP))) {
        logmsg("out of memory");
        return;
    }
    for (int iter = 0; (hangup || iter < 64) && conn_fd >= 0; iter++) {
        if (!hangup && outq_bytes >= OUTQ_SOFT_MAX)
            break; /* EPOLLIN is off until the queue drains (update_conn_events) */
        ssize_t n = read(conn_fd, inbuf + in_have, STREAM_IN_CAP - in_have);
        if (n < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)
                break;
            if (conn_is_port) {
                logmsg("port read: %s", strerror(errno));
                break;
            }
            drop_conn("recv failed");
            return;
        }
        if (n == 0) {
            if (conn_is_port) /* nothing buffered and the host is not connected */
                break;
            drop_conn("edge closed the connection");
            return;
        }
        in_have += (size_t)n;
        if (parse_stream() < 0 && !conn_is_port)
            return;
        if (in_have == STREAM_IN_CAP) { /* cannot happen with frames <= MAX_PACKET */
            drop_conn("input buffer full");
            return;
        }
    }
    update_conn_events();
}

/* hangup: the peer is gone; read what it sent before (finite) regardless of backpressure. */
static void read_conn(int hangup)
{
    if (stream_mode) {
        read_stream(hangup);
        return;
    }
    for (int iter = 0; (hangup || iter < 64) && conn_fd >= 0; iter++) {
        if (!hangup && outq_bytes >= OUTQ_SOFT_MAX)
            break;
        if (!rxbuf && !(rxbuf = malloc(MAX_PACKET))) {
            logmsg("out of memory");
            return;
        }
        union {
            struct cmsghdr h;
            char buf[CMSG_SPACE(sizeof(int) * 4)];
        } ctl;
        struct iovec iov = {.iov_base = rxbuf, .iov_len = MAX_PACKET};
        struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.buf,
                            .msg_controllen = sizeof ctl.buf};
        ssize_t n = recvmsg(conn_fd, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
        if (n < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)
                break;
            drop_conn("recv failed");
            return;
        }
        /* One passed fd at most (EXEC's session cgroup). */
        int fd = -1, nfds = take_fds(&mh, &fd, 1);
        if (n == 0) {
            if (nfds > 0)
                close(fd);
            drop_conn("edge closed the connection");
            return;
        }
        if (nfds < 0) {
            drop_conn("oversized packet or too many fds");
            return;
        }
        if (handle_packet(rxbuf, (size_t)n, fd) < 0) {
            drop_conn("malformed packet");
            return;
        }
    }
    update_conn_events();
}

/* ---------- children ---------- */

static void reap(void)
{
    struct signalfd_siginfo si;
    while (read(sig_fd, &si, sizeof si) == (ssize_t)sizeof si)
        ;
    for (;;) {
        int status;
        pid_t pid = waitpid(-1, &status, WNOHANG);
        if (pid <= 0)
            break;
        if (sudo_reaped(pid, status))
            continue;
        for (struct session *s = sessions; s; s = s->next)
            if (s->pid == pid && !s->reaped) {
                s->reaped = 1;
                s->wstatus = status;
                s->drain_deadline_ms = now_ms() + DRAIN_MS;
                break;
            }
    }
}

/* One turn of work on every session. Frees finished sessions. */
static void service_sessions(int64_t now)
{
    struct session *s = sessions, *next;
    for (; s; s = next) {
        next = s->next;
        if (s->state == S_FAILED) {
            if (s->reaped)
                free_session(s);
            continue;
        }
        if (s->state == S_EXITED)
            continue;
        if (s->deadline_ms && !s->reaped && now >= s->deadline_ms) {
            s->timed_out = 1;
            s->deadline_ms = 0;
            kill_session(s);
        }
        if (s->state == S_SPAWNING)
            continue; /* no output before STARTED */
        pump_stdin(s);
        for (int i = 0; i < 2; i++)
            if (s->out_ready[i])
                pump(s, i, READS_PER_TURN, 0);
        if (!s->reaped)
            continue;
        int drained = s->out_fd[0] < 0 && s->out_fd[1] < 0;
        if (!drained && now >= s->drain_deadline_ms) {
            /* Leftover writers keep the pipes open: take what is there now, then stop. */
            for (int i = 0; i < 2; i++)
                pump(s, i, FINAL_DRAIN_MAX / CHUNK, 1);
            drained = 1;
        }
        if (drained)
            finish_session(s);
    }
    evict_exited();
}

static int next_timeout(int64_t now)
{
    if (more_work)
        return 0;
    /* No timer: sleep until an event (no periodic wakeups; thousands of idle agents per node). */
    int64_t t = INT64_MAX;
    for (struct session *s = sessions; s; s = s->next) {
        if (s->deadline_ms && !s->reaped && s->deadline_ms < t)
            t = s->deadline_ms;
        if (s->reaped && s->state != S_FAILED && s->state != S_EXITED &&
            s->drain_deadline_ms < t)
            t = s->drain_deadline_ms;
        if (s->state == S_RUNNING && (s->out_ready[0] || s->out_ready[1]) &&
            (conn_fd < 0 || !outq_head))
            return 0;
    }
    if (t == INT64_MAX)
        return -1;
    return t <= now ? 0 : t - now > 60000 ? 60000 : (int)(t - now);
}

static void ensure_stdio(void)
{
    for (int fd = 0; fd < 3; fd++)
        if (fcntl(fd, F_GETFD) < 0) {
            int n = open("/dev/null", O_RDWR);
            if (n >= 0 && n != fd) {
                dup2(n, fd);
                close(n);
            }
        }
}


/* ---------- guest mode: the agent as a microVM's init ---------- */

/* Record the first failed boot step (BOOT_INFO tells the host; the agent serves anyway so
 * the host learns why instead of waiting for a timeout). */
static void boot_fail(int err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void boot_fail(int err, const char *fmt, ...)
{
    char msg[BOOT_ERR_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    logmsg("boot: %s: %s", msg, strerror(err));
    if (!boot_errno) {
        boot_errno = err ? err : EIO;
        if (snprintf(boot_err, sizeof boot_err, "%s: %s", msg, strerror(boot_errno)) < 0)
            boot_err[0] = 0;
    }
}

static int mount_at(const char *src, const char *dst, const char *type, unsigned long flags,
                    const char *opts)
{
    mkdir(dst, 0755);
    if (mount(src, dst, type, flags, opts) < 0) {
        boot_fail(errno, "mount %s on %s", type, dst);
        return -1;
    }
    return 0;
}

/* The sandbox's /dev: a tmpfs with a container's few character devices, not the guest's
 * devtmpfs (its raw disks would give a command the layers' bytes past the hidden paths' masks,
 * and the agent's port). Commands can not make more (no MKNOD) nor mount one (no SYS_ADMIN);
 * the unhardened twin (rollbox.fullroot=1) gets the devtmpfs. */
static int sandbox_dev(const char *dev)
{
    if (guest_full_root)
        return mount_at("devtmpfs", dev, "devtmpfs", MS_NOSUID, "mode=0755");
    if (mount_at("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=64k") < 0)
        return -1;
    static const struct { const char *name; unsigned maj, min; mode_t mode; } nodes[] = {
        {"null", 1, 3, 0666}, {"zero", 1, 5, 0666}, {"full", 1, 7, 0666},
        {"random", 1, 8, 0666}, {"urandom", 1, 9, 0666}, {"tty", 5, 0, 0666}};
    static const char *const links[][2] = {
        {"fd", "/proc/self/fd"}, {"stdin", "/proc/self/fd/0"}, {"stdout", "/proc/self/fd/1"},
        {"stderr", "/proc/self/fd/2"}, {"ptmx", "pts/ptmx"}};
    char path[128];
    for (size_t i = 0; i < sizeof nodes / sizeof nodes[0]; i++) {
        snprintf(path, sizeof path, "%s/%s", dev, nodes[i].name);
        if (mknod(path, S_IFCHR | nodes[i].mode, makedev(nodes[i].maj, nodes[i].min)) < 0 ||
            chmod(path, nodes[i].mode) < 0) {
            boot_fail(errno, "mknod %s", path);
            return -1;
        }
    }
    for (size_t i = 0; i < sizeof links / sizeof links[0]; i++) {
        snprintf(path, sizeof path, "%s/%s", dev, links[i][0]);
        if (symlink(links[i][1], path) < 0) {
            boot_fail(errno, "symlink %s", path);
            return -1;
        }
    }
    return 0;
}

static int write_file(const char *path, const char *text)
{
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    ssize_t n = write(fd, text, strlen(text));
    int err = errno;
    close(fd);
    errno = err;
    return n == (ssize_t)strlen(text) ? 0 : -1;
}

/* The value of `key=` on the kernel command line, into buf (empty if absent). */
static void cmdline_value(const char *cmdline, const char *key, char *buf, size_t n)
{
    size_t klen = strlen(key);
    buf[0] = 0;
    for (const char *p = cmdline; (p = strstr(p, key)); p += klen) {
        if ((p == cmdline || p[-1] == ' ') && p[klen] == '=') {
            size_t len = strcspn(p + klen + 1, " \n");
            if (len >= n)
                len = n - 1;
            memcpy(buf, p + klen + 1, len);
            buf[len] = 0;
            return;
        }
    }
}

/* Is there a virtio device of this id (/sys/bus/virtio/devices/<d>/device: "0x0001")? */
static int virtio_device_present(int id)
{
    char want[16], dev[64];
    snprintf(want, sizeof want, "0x%04x", id);
    return sysfs_dev("/sys/bus/virtio/devices", "virtio", "device", want, dev, sizeof dev, 0) == 0;
}

/* /lib/modules/load.list: "<file>" or "<file> <virtio device id>" (loaded only if such a
 * device exists: no NIC, no pmem, no driver to load), dependencies first. */
static void load_modules(void)
{
    FILE *f = fopen("/lib/modules/load.list", "re");
    if (!f) {
        boot_fail(errno, "open /lib/modules/load.list");
        return;
    }
    char name[128], path[192];
    while (fgets(name, sizeof name, f)) {
        name[strcspn(name, "\n")] = 0;
        char *dev = strchr(name, ' ');
        if (dev) {
            *dev++ = 0;
            if (!virtio_device_present(atoi(dev)))
                continue;
        }
        if (!name[0] || strchr(name, '/'))
            continue;
        snprintf(path, sizeof path, "/lib/modules/%s", name);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0 || (syscall(SYS_finit_module, fd, "", 0) < 0 && errno != EEXIST))
            boot_fail(errno, "load module %s", name);
        if (fd >= 0)
            close(fd);
    }
    fclose(f);
}

/* /dev/<entry> of the entry of sysfs directory `dir` (names starting with `prefix`) whose
 * attribute file `attr` reads `want`, into dev; 0 when found (and, with need_node, its node
 * exists). Disks by serial (/sys/block/vdX/serial), the agent's port by name (no udev: no
 * /dev/virtio-ports), virtio devices by id. */
static int sysfs_dev(const char *dir, const char *prefix, const char *attr, const char *want,
                     char *dev, size_t n, int need_node)
{
    DIR *d = opendir(dir);
    if (!d)
        return -1;
    struct dirent *e;
    int found = -1;
    while (found < 0 && (e = readdir(d))) {
        if (e->d_name[0] == '.' || strncmp(e->d_name, prefix, strlen(prefix)) != 0)
            continue;
        char path[320], buf[128];
        if (snprintf(path, sizeof path, "%s/%s/%s", dir, e->d_name, attr) >= (int)sizeof path)
            continue;
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0)
            continue;
        ssize_t r = read(fd, buf, sizeof buf - 1);
        close(fd);
        if (r <= 0)
            continue;
        buf[r] = 0;
        buf[strcspn(buf, "\n")] = 0;
        if (strcmp(buf, want) == 0 && snprintf(dev, n, "/dev/%s", e->d_name) < (int)n)
            found = !need_node || access(dev, F_OK) == 0 ? 0 : -1;
    }
    closedir(d);
    return found;
}

static int disk_by_serial(const char *serial, char *dev, size_t n)
{
    return sysfs_dev("/sys/block", "vd", "serial", serial, dev, n, 1);
}

static int port_by_name(const char *name, char *dev, size_t n)
{
    return sysfs_dev("/sys/class/virtio-ports", "", "name", name, dev, n, 1);
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* Mount everything the sandbox root needs; on failure the first error is recorded and the
 * agent still serves. Returns the fd of the open virtio port, or -1. */
/* The guest's loopback up (a VM's kernel starts with it down): commands' own local services
 * (a test server, a browser task's page) reach 127.0.0.1 whether or not the VM has a NIC. */
static void loopback_up(void)
{
    int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    strcpy(ifr.ifr_name, "lo");
    if (s < 0 || ioctl(s, SIOCGIFFLAGS, &ifr) < 0 ||
        (ifr.ifr_flags |= IFF_UP, ioctl(s, SIOCSIFFLAGS, &ifr) < 0))
        boot_fail(errno, "loopback up");
    if (s >= 0)
        close(s);
}

static int open_port(int port_ok, const char *port)
{
    if (port_ok != 0) {
        boot_fail(ENODEV, "virtio-serial port %s not found", GUEST_PORT_NAME);
        return -1;
    }
    int fd = open(port, O_RDWR | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
    if (fd < 0)
        boot_fail(errno, "open %s", port);
    return fd;
}

/* A disk image's root (rollbox.root=1): its ext4 disk read-write at SANDBOX_ROOT with proc,
 * sys, the guest's devtmpfs and a devpts in it (the image's init and its services need the
 * real devices: the DRM card, input, ttys; the image's root owns the guest anyway). The rest
 * (cgroup2, /run, /dev/shm) is the image's init's to mount. The platform tools' view is the
 * root alone (not recursive: no /proc, /dev of it), with no overlay upper. */
static int root_mounts(const char *dev)
{
    if (mount_at(dev, SANDBOX_ROOT, "ext4", 0, NULL) < 0 ||
        mount_at("proc", SANDBOX_ROOT "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC,
                 NULL) < 0 ||
        mount_at("sysfs", SANDBOX_ROOT "/sys", "sysfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
                 NULL) < 0 ||
        mount_at("devtmpfs", SANDBOX_ROOT "/dev", "devtmpfs", MS_NOSUID, "mode=0755") < 0 ||
        mount_at("devpts", SANDBOX_ROOT "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC,
                 "newinstance,ptmxmode=0666,mode=0620,gid=5") < 0)
        return -1;
    root_fd = open(SANDBOX_ROOT, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (root_fd < 0) {
        boot_fail(errno, "open the sandbox root");
        return -1;
    }
    if (mount_at(SANDBOX_ROOT, TOOL_VIEW, NULL, MS_BIND, NULL) < 0 ||
        mount(NULL, TOOL_VIEW, NULL, MS_PRIVATE, NULL) < 0) {
        boot_fail(errno, "the platform tools' view of the sandbox");
        return -1;
    }
    view_fd = open(TOOL_VIEW, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (view_fd < 0)
        boot_fail(errno, "open the platform tools' view");
    return view_fd < 0 ? -1 : 0;
}

/* The disk image's hand-over: fork; the child stays the agent (its root the initramfs,
 * commands chrooted into SANDBOX_ROOT), PID 1 chroots into SANDBOX_ROOT and execs `init`
 * with the kernel's arguments to /init and its environment. An init that can not be exec'd
 * is the agent's boot error (told through a close-on-exec pipe: EOF means the exec
 * happened); PID 1 then only reaps. No fork (or no init named): the agent stays PID 1 and
 * reports it. */
static void hand_over(const char *init)
{
    if (init[0] != '/') {
        boot_fail(EINVAL, "rollbox.init=%s (an absolute path in the disk image)", init);
        return;
    }
    int p[2];
    if (pipe2(p, O_CLOEXEC) < 0) {
        boot_fail(errno, "pipe for the hand-over to %s", init);
        return;
    }
    pid_t pid = fork();
    if (pid < 0) {
        boot_fail(errno, "fork for the hand-over to %s", init);
        close(p[0]);
        close(p[1]);
        return;
    }
    if (pid > 0) { /* PID 1: the image's init */
        sigset_t none;
        sigemptyset(&none);
        for (int sig = 1; sig < NSIG; sig++)
            signal(sig, SIG_DFL);
        sigprocmask(SIG_SETMASK, &none, NULL);
        for (int fd = 3; fd < 1024; fd++)
            if (fd != p[1])
                close(fd);
        char *args[64];
        int n = 0;
        args[n++] = (char *)init;
        for (int i = 1; i < guest_argc && n < 63; i++)
            if (strcmp(guest_argv[i], "--guest") != 0)
                args[n++] = guest_argv[i];
        args[n] = NULL;
        int err = 0;
        if (chdir(SANDBOX_ROOT) < 0 || chroot(".") < 0 || chdir("/") < 0)
            err = errno;
        else {
            execve(init, args, environ);
            err = errno;
        }
        if (write(p[1], &err, sizeof err) < 0)
            err = 0;
        close(p[1]);
        for (;;) /* PID 1 must not exit: reap orphans until the guest is stopped */
            if (wait(NULL) < 0)
                pause();
    }
    close(p[1]);
    prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0); /* its commands' orphans stay the agent's */
    /* A signalfd made before the fork wakes epoll for the process that made it (its wait
     * queue is PID 1's): this process's SIGCHLDs would never wake the loop. A new one. */
    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGCHLD);
    epoll_ctl(ep, EPOLL_CTL_DEL, sig_fd, NULL);
    close(sig_fd);
    sig_fd = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
    if (sig_fd < 0)
        boot_fail(errno, "signalfd after the hand-over");
    else
        ep_add(sig_fd, EPOLLIN, &w_signal);
    /* Out of the root cgroup into one of its own, beside the session cgroups: the image's
     * systemd moves what it finds in the root cgroup into its init.scope (a unit); a cgroup
     * it did not make is not its to manage. */
    if ((mkdir(AGENT_CGROUP, 0755) < 0 && errno != EEXIST) ||
        write_file(AGENT_CGROUP "/cgroup.procs", "0") < 0)
        boot_fail(errno, "move the agent into " AGENT_CGROUP);
    int err = 0;
    ssize_t r;
    do
        r = read(p[0], &err, sizeof err);
    while (r < 0 && errno == EINTR);
    close(p[0]);
    if (r == (ssize_t)sizeof err)
        boot_fail(err, "exec %s in the disk image", init);
    else
        logmsg("handed PID 1 over to %s; the agent is pid %d", init, (int)getpid());
}

static int guest_init(void)
{
    t_init = boottime_ns();
    mkdir("/proc", 0555);
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    mount("sysfs", "/sys", "sysfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    mount("devtmpfs", "/dev", "devtmpfs", MS_NOSUID, "mode=0755");
    mount_at("cgroup2", "/sys/fs/cgroup", "cgroup2", MS_NOSUID | MS_NODEV | MS_NOEXEC,
             "nsdelegate");
    mount("tmpfs", "/run", "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755");
    /* fds 0-2 are /dev/console when the initramfs has it; else make them /dev/null. */
    ensure_stdio();
    if (write_file("/sys/fs/cgroup/cgroup.subtree_control", "+memory +pids +cpu") < 0)
        boot_fail(errno, "enable cgroup controllers");
    pids_fd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
    if (pids_fd < 0)
        logmsg("inotify: %s (leftovers of ended commands are not watched)", strerror(errno));
    if (mkdir("/sys/fs/cgroup/rollbox", 0755) < 0 ||
        write_file("/sys/fs/cgroup/rollbox/cgroup.subtree_control", "+memory +pids +cpu") < 0)
        boot_fail(errno, "session cgroup parent");
    else
        premake_session_cgroups();

    load_modules();
    t_modules = boottime_ns();
    loopback_up();

    char cmdline[4096] = "", val[32];
    int cfd = open("/proc/cmdline", O_RDONLY | O_CLOEXEC);
    if (cfd >= 0) {
        ssize_t r = read(cfd, cmdline, sizeof cmdline - 1);
        cmdline[r > 0 ? r : 0] = 0;
        close(cfd);
    }
    cmdline_value(cmdline, "rollbox.layers", val, sizeof val);
    int layers = atoi(val);
    /* A disk image guest (rollbox.root=1, docs/backends/vm.md): no layers, no rw disk; the
     * root is the disk of serial "root" and PID 1 becomes the image's init (rollbox.init). */
    cmdline_value(cmdline, "rollbox.root", val, sizeof val);
    int root_disk = strcmp(val, "1") == 0;
    char init_path[256];
    cmdline_value(cmdline, "rollbox.init", init_path, sizeof init_path);
    cmdline_value(cmdline, "rollbox.rw", val, sizeof val);
    int rw = strcmp(val, "1") == 0; /* else the upper is a tmpfs */
    /* The sandbox's pids limit on the parent of every session cgroup (a fork bomb fills it,
     * not the guest's process table); on the command line, so a template's restored guest
     * has the limit of its key. */
    cmdline_value(cmdline, "rollbox.fullroot", val, sizeof val);
    guest_full_root = strcmp(val, "1") == 0;
    cmdline_value(cmdline, "rollbox.pids", val, sizeof val);
    if (val[0] && strspn(val, "0123456789") != strlen(val))
        boot_fail(EINVAL, "rollbox.pids=%s", val);
    else if (val[0] && write_file("/sys/fs/cgroup/rollbox/pids.max", val) < 0)
        boot_fail(errno, "rollbox.pids=%s", val);
    if (root_disk) {
        if (layers != 0)
            boot_fail(EINVAL, "rollbox.layers=%d with rollbox.root=1", layers);
        layers = 0;
        rw = 0;
    } else if (layers < 1 || layers > 64) {
        boot_fail(EINVAL, "rollbox.layers=%d (1 to 64)", layers);
        layers = 0;
    }

    /* Disks appear as virtio-blk probes them (asynchronously): wait, bounded. */
    char devs[65][32], port[64] = "";
    int have = 0, port_ok = -1;
    int64_t deadline = now_ms() + GUEST_DEVICE_WAIT_MS;
    for (;;) {
        have = 0;
        for (int i = 0; i < layers; i++) {
            char serial[32];
            snprintf(serial, sizeof serial, "layer%d", i);
            have += disk_by_serial(serial, devs[i], sizeof devs[i]) == 0;
        }
        int rw_ok = root_disk ? disk_by_serial("root", devs[64], sizeof devs[64]) == 0
                              : !rw || disk_by_serial("rw", devs[64], sizeof devs[64]) == 0;
        if (port_ok < 0)
            port_ok = port_by_name(GUEST_PORT_NAME, port, sizeof port);
        if ((have == layers && rw_ok && port_ok == 0) || now_ms() > deadline) {
            if (have < layers)
                boot_fail(ENODEV, "%d of %d layer disks found (serial layerN)", have,
                          layers);
            if (!rw_ok)
                boot_fail(ENODEV, root_disk ? "root disk (serial root) not found"
                                            : "writable disk (serial rw) not found");
            break;
        }
        sleep_ms(2);
    }
    t_disks = boottime_ns();

    if (root_disk) {
        int ok = have == 0 && !boot_errno && root_mounts(devs[64]) == 0;
        t_mounts = boottime_ns();
        shell_fd = open("/platform/bash", O_RDONLY | O_CLOEXEC);
        tool_fd = open("/platform/busybox", O_RDONLY | O_CLOEXEC);
        self_fd = open("/proc/self/exe", O_RDONLY | O_CLOEXEC);
        if (shell_fd < 0 || tool_fd < 0)
            boot_fail(errno, "platform tools in the initramfs");
        if (ok)
            hand_over(init_path);
        return open_port(port_ok, port);
    }

    int ok = have == layers && layers > 0;
    char lower[64 * 16 + 1] = "";
    for (int i = layers - 1; ok && i >= 0; i--) {
        char dir[32];
        snprintf(dir, sizeof dir, "/layers/%d", i);
        ok = mount_at(devs[i], dir, "erofs", MS_RDONLY | MS_NODEV, NULL) == 0;
        size_t len = strlen(lower);
        snprintf(lower + len, sizeof lower - len, "%s%s", len ? ":" : "", dir);
    }
    if (ok)
        ok = rw ? mount_at(devs[64], "/rw", "ext4", MS_NODEV, NULL) == 0
                : mount_at("tmpfs", "/rw", "tmpfs", MS_NODEV, "mode=0755") == 0;
    if (ok && ((mkdir("/rw/upper", 0755) < 0 && errno != EEXIST) ||
               (mkdir("/rw/work", 0755) < 0 && errno != EEXIST))) {
        boot_fail(errno, "upper and work dirs on the writable disk");
        ok = 0;
    }
    if (ok) {
        char opts[64 * 16 + 128];
        snprintf(opts, sizeof opts,
                 "lowerdir=%s,upperdir=/rw/upper,workdir=/rw/work,redirect_dir=off,"
                 "metacopy=off", lower);
        /* redirect_dir=off: the upper stays a self-contained layer (snapshot). */
        ok = mount_at("overlay", SANDBOX_ROOT, "overlay", 0, opts) == 0;
    }
    if (ok) {
        ok = mount_at("proc", SANDBOX_ROOT "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC,
                      NULL) == 0 &&
             mount_at("sysfs", SANDBOX_ROOT "/sys", "sysfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
                      NULL) == 0 &&
             mount_at("cgroup2", SANDBOX_ROOT "/sys/fs/cgroup", "cgroup2",
                      MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) == 0 &&
             sandbox_dev(SANDBOX_ROOT "/dev") == 0 &&
             mount_at("devpts", SANDBOX_ROOT "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC,
                      "newinstance,ptmxmode=0666,mode=0620") == 0 &&
             mount_at("tmpfs", SANDBOX_ROOT "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV,
                      "mode=1777") == 0 &&
             mount_at("tmpfs", SANDBOX_ROOT "/run", "tmpfs", MS_NOSUID | MS_NODEV,
                      "mode=0755") == 0;
        if (ok) {
            root_fd = open(SANDBOX_ROOT, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
            if (root_fd < 0)
                boot_fail(errno, "open the sandbox root");
        }
        /* Not recursive: the view holds the overlay alone (see TOOL_VIEW). */
        if (ok && mount_at(SANDBOX_ROOT, TOOL_VIEW, NULL, MS_BIND, NULL) == 0 &&
            mount(NULL, TOOL_VIEW, NULL, MS_PRIVATE, NULL) == 0 &&
            mount("/rw/upper", TOOL_VIEW_UPPER, NULL, MS_BIND, NULL) == 0 &&
            mount(NULL, TOOL_VIEW_UPPER, NULL,
                  MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
                  NULL) == 0) {
            view_fd = open(TOOL_VIEW, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
            if (view_fd < 0)
                boot_fail(errno, "open the platform tools' view");
        } else if (ok) {
            boot_fail(errno, "the platform tools' view of the sandbox");
        }
    }
    t_mounts = boottime_ns();
    sethostname("sandbox", 7);

    shell_fd = open("/platform/bash", O_RDONLY | O_CLOEXEC);
    tool_fd = open("/platform/busybox", O_RDONLY | O_CLOEXEC);
    self_fd = open("/proc/self/exe", O_RDONLY | O_CLOEXEC); /* the initramfs' /init */
    if (shell_fd < 0 || tool_fd < 0)
        boot_fail(errno, "platform tools in the initramfs");
    return open_port(port_ok, port);
}

/* The virtio port while the host is not connected: reads return 0 and poll says POLLHUP
 * until it is, so it is watched edge-triggered (woken when the host connects) instead of
 * level-triggered (a busy loop). */
static void port_set_mode(int et)
{
    port_et = et;
    struct epoll_event ev = {.events = et ? (EPOLLIN | EPOLLET) : EPOLLIN, .data.ptr = w_conn};
    epoll_ctl(ep, EPOLL_CTL_MOD, conn_fd, &ev);
    conn_events = et ? 0 : EPOLLIN;
    if (!et)
        update_conn_events();
}

static void port_discard_input(void)
{
    char buf[4096];
    while (read(conn_fd, buf, sizeof buf) > 0)
        ;
    in_have = 0;
}

static void port_event(uint32_t e)
{
    if (port_et) {
        struct pollfd pfd = {.fd = conn_fd, .events = POLLIN};
        if (poll(&pfd, 1, 0) < 0 || (pfd.revents & POLLHUP)) {
            port_discard_input();
            return;
        }
        port_set_mode(0); /* the host is back: wait for its HELLO */
        read_conn(0);
        return;
    }
    if (e & EPOLLHUP) {
        /* The guest learns of host (dis)connections asynchronously: a HUP of the previous
         * host can be reported after the next one's HELLO. Only a HUP that still holds
         * drops the connection. */
        struct pollfd pfd = {.fd = conn_fd, .events = POLLIN};
        if (poll(&pfd, 1, 0) == 1 && !(pfd.revents & POLLHUP)) {
            flush_outq();
            read_conn(0);
            return;
        }
        drop_conn("host disconnected (POLLHUP on the port)");
        port_discard_input();
        conn_state = C_HUNT;
        port_set_mode(1);
        return;
    }
    if (e & EPOLLOUT)
        flush_outq();
    if (e & EPOLLIN)
        read_conn(0);
}

/* ---------- rollbox.tty1=1: the platform busybox sh on the VGA screen's tty ----------
 * A full VM's test guest (docs/backends/vm.md, "Two kinds of guest", 1.): with rollbox.tty1=1
 * the agent starts the platform's busybox `sh` (by descriptor: never a binary of the sandbox)
 * on /dev/tty1, chrooted into the sandbox root with a command's capabilities, in its own
 * cgroup under the sessions' parent (so the sandbox's pids limit counts it), so a person at
 * the live view types into the sandbox as a command would run there. A small supervisor
 * (a fork of the agent that keeps only the two descriptors it needs) starts it again, at most
 * once a second, when it exits. Nothing else of the agent depends on it. */
#define TTY1_DEV "/dev/tty1"
#define TTY1_CGROUP "/sys/fs/cgroup/rollbox/tty1"

static int tty1_wanted(void)
{
    char cmdline[4096] = "", val[8];
    int cfd = open("/proc/cmdline", O_RDONLY | O_CLOEXEC);
    if (cfd < 0)
        return 0;
    ssize_t r = read(cfd, cmdline, sizeof cmdline - 1);
    cmdline[r > 0 ? r : 0] = 0;
    close(cfd);
    cmdline_value(cmdline, "rollbox.tty1", val, sizeof val);
    return strcmp(val, "1") == 0;
}

static void tty1_shell_exec(void)
{
    static char *const argv[] = {"sh", NULL};
    static char *const envp[] = {"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                                 "HOME=/root", "TERM=linux", "PS1=sandbox:\\w# ", NULL};
    if (setsid() < 0)
        _exit(126);
    int cg = open(TTY1_CGROUP "/cgroup.procs", O_WRONLY | O_CLOEXEC);
    if (cg < 0 || write(cg, "0", 1) != 1)
        _exit(126);
    close(cg);
    int tty = open(TTY1_DEV, O_RDWR | O_CLOEXEC); /* the initramfs' devtmpfs, before the chroot */
    if (tty < 0 || ioctl(tty, TIOCSCTTY, 1) < 0 || dup2(tty, 0) < 0 || dup2(tty, 1) < 0 ||
        dup2(tty, 2) < 0)
        _exit(126);
    if (tty > 2)
        close(tty);
    if (fchdir(root_fd) < 0 || chroot(".") < 0 || chdir("/") < 0)
        _exit(126);
    if (!guest_full_root && drop_guest_caps() < 0)
        _exit(126);
    umask(022);
    syscall(SYS_execveat, tool_fd, "", argv, envp, AT_EMPTY_PATH);
    _exit(127);
}

static void tty1_start(void)
{
    if (root_fd < 0 || tool_fd < 0) {
        logmsg("rollbox.tty1: no sandbox root or platform busybox: no shell on tty1");
        return;
    }
    if (mkdir(TTY1_CGROUP, 0755) < 0 && errno != EEXIST) {
        logmsg("rollbox.tty1: cgroup: %s", strerror(errno));
        return;
    }
    pid_t sup = fork();
    if (sup != 0) {
        if (sup < 0)
            logmsg("rollbox.tty1: fork: %s", strerror(errno));
        return; /* the agent reaps the supervisor if it ever ends (an unknown pid) */
    }
    /* The supervisor: none of the agent's descriptors but the sandbox root and the tool. */
    prctl(PR_SET_NAME, "rollbox-tty1", 0, 0, 0);
    for (int fd = 3; fd < 4096; fd++)
        if (fd != root_fd && fd != tool_fd)
            close(fd);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    signal(SIGPIPE, SIG_DFL);
    for (;;) {
        int64_t started = now_ms();
        pid_t sh = fork();
        if (sh == 0)
            tty1_shell_exec();
        if (sh > 0)
            while (waitpid(sh, NULL, 0) < 0 && errno == EINTR)
                ;
        int64_t ran = now_ms() - started;
        if (ran < 1000)
            sleep_ms((int)(1000 - ran));
    }
}

int main(int argc, char **argv)
{
    if (argc > 0 && strcmp(argv[0], XATTR_TOOL) == 0) /* a platform tool, exec'd by a spawn */
        return xattr_tool(argc > 1 ? argv[1] : NULL);
    if (argc > 0 && strcmp(argv[0], WATCH_TOOL) == 0)
        return watch_tool(argc, argv);
    if (argc > 0 && strcmp(argv[0], XATTR_FILE_TOOL) == 0)
        return xattr_file_tool(argc, argv);
    /* First: nothing in the sandbox may ptrace us or open /proc/1/{fd,mem}. */
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    /* Started by a kernel (a microVM's /init): no listening socket, we build the root. */
    guest_mode = (getpid() == 1 && fcntl(LISTEN_FD, F_GETFD) < 0) ||
                 (argc > 1 && strcmp(argv[1], "--guest") == 0);
    /* runc exec'd us from fd 4 (our own binary, never a path in the sandbox): kept
     * close-on-exec as self_fd (the built-in tools are exec'd from it, so only a spawned child
     * holds it, until that exec), like the platform shell below; guest mode opens its own. */
    struct stat self_st;
    if (!guest_mode && fstat(AGENT_EXE_FD, &self_st) == 0 && S_ISREG(self_st.st_mode) &&
        fcntl(AGENT_EXE_FD, F_SETFD, FD_CLOEXEC) == 0)
        self_fd = AGENT_EXE_FD;
    else
        close(AGENT_EXE_FD);
    /* The platform shell (an fd of the host's root-owned copy, like fd 4): kept, close-on-exec,
     * so only the children that exec it hold it, and only until that exec. */
    struct stat shell_st;
    if (fstat(PLATFORM_SHELL_FD, &shell_st) == 0 && S_ISREG(shell_st.st_mode) &&
        fcntl(PLATFORM_SHELL_FD, F_SETFD, FD_CLOEXEC) == 0)
        shell_fd = PLATFORM_SHELL_FD;
    else
        close(PLATFORM_SHELL_FD);
    if (fstat(PLATFORM_TOOL_FD, &shell_st) == 0 && S_ISREG(shell_st.st_mode) &&
        fcntl(PLATFORM_TOOL_FD, F_SETFD, FD_CLOEXEC) == 0)
        tool_fd = PLATFORM_TOOL_FD;
    else
        close(PLATFORM_TOOL_FD);
    prctl(PR_SET_NAME, "rollbox-agent", 0, 0, 0); /* exec'd as /proc/self/fd/4, comm was "4" */
    if (getpid() != 1)
        prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
    /* Every disposition back to the default once (an ignored one would outlive a command's
     * exec), so a command's child needs to reset only SIGPIPE. */
    for (int sig = 1; sig < NSIG; sig++)
        signal(sig, SIG_DFL);
    signal(SIGPIPE, SIG_IGN);
    /* A fixed mmap threshold (glibc raises it after the first big free): retention rings are
     * their own mappings, so a collected session's memory goes back to the kernel at once. */
    mallopt(M_MMAP_THRESHOLD, 128 * 1024);
    ensure_stdio();
    landlock_init();
    /* Only SIGCHLD is blocked (for signalfd). Other signals keep SIG_DFL so the host can stop
     * us (runc kill); as PID 1 the kernel already drops them when sent from inside. */
    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGCHLD);
    sigprocmask(SIG_BLOCK, &mask, NULL);
    sig_fd = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
    ep = epoll_create1(EPOLL_CLOEXEC);
    if (sig_fd < 0 || ep < 0) {
        logmsg("signalfd/epoll: %s", strerror(errno));
        return 1;
    }
    ep_add(sig_fd, EPOLLIN, &w_signal);
    if (guest_mode) {
        guest_argc = argc;
        guest_argv = argv;
        stream_mode = conn_is_port = 1;
        conn_state = C_HUNT;
        conn_fd = guest_init();
        if (conn_fd >= 0) {
            conn_events = EPOLLIN;
            ep_add(conn_fd, conn_events, w_conn); /* a HUP event switches it to ET */
        } else {
            logmsg("no agent port: commands can not reach this guest");
        }
        if (tty1_wanted())
            tty1_start();
        if (pids_fd >= 0)
            ep_add(pids_fd, EPOLLIN, &w_pids);
    } else {
        int fl = fcntl(LISTEN_FD, F_GETFD);
        if (fl < 0) {
            logmsg("fd 3 (listening socket) is not open");
            return 1;
        }
        int type = 0;
        socklen_t tlen = sizeof type;
        if (getsockopt(LISTEN_FD, SOL_SOCKET, SO_TYPE, &type, &tlen) == 0 &&
            type == SOCK_STREAM)
            stream_mode = 1; /* framed, HELLO per connection: the VM transport on a socket */
        fcntl(LISTEN_FD, F_SETFD, fl | FD_CLOEXEC);
        set_nonblock(LISTEN_FD);
        ep_add(LISTEN_FD, EPOLLIN, &w_listen);
    }
    t_ready = boottime_ns();

    struct epoll_event evs[64];
    for (;;) {
        int64_t now = now_ms();
        int timeout = next_timeout(now);
        more_work = 0;
        int n = epoll_wait(ep, evs, 64, timeout);
        if (n < 0 && errno != EINTR) {
            logmsg("epoll_wait: %s", strerror(errno));
            struct timespec ts = {0, 10 * 1000 * 1000};
            nanosleep(&ts, NULL);
        }
        for (int i = 0; i < n; i++) {
            struct watch *w = evs[i].data.ptr;
            uint32_t e = evs[i].events;
            switch (w->kind) {
            case W_LISTEN:
                accept_conn();
                break;
            case W_CONN:
                if (w != w_conn || conn_fd < 0)
                    break; /* stale event of a replaced connection */
                if (conn_is_port) {
                    port_event(e);
                    break;
                }
                if (e & EPOLLOUT)
                    flush_outq();
                if (e & (EPOLLHUP | EPOLLERR | EPOLLRDHUP)) {
                    read_conn(1); /* take the last requests (e.g. KILL), then hang up */
                    drop_conn("edge hung up");
                } else if (e & EPOLLIN) {
                    read_conn(0);
                }
                break;
            case W_SIGNAL:
                reap();
                break;
            case W_OUT:
                w->s->out_ready[0] = 1;
                break;
            case W_ERR:
                w->s->out_ready[1] = 1;
                break;
            case W_IN:
                w->s->in_ready = 1;
                if (e & (EPOLLERR | EPOLLHUP))
                    discard_stdin(w->s);
                break;
            case W_PIDS:
                pids_events();
                break;
            case W_SUDO_LISTEN:
                sudo_accept();
                break;
            case W_SUDO_CONN:
                sudo_conn_event(sudo_slot(w), e);
                break;
            }
        }
        flush_outq();
        service_sessions(now_ms());
        flush_outq();
    }
}
