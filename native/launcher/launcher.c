/* rollbox-launcher: start one container sandbox's init (the agent), rollbox's own runtime.
 *
 * One process spawn per sandbox (no Go runtime, no re-exec of itself), linked statically against
 * musl where the build host has it (Makefile: glibc's start-up cpuid probing is ~0.5 ms of VM
 * exits per spawn on a virtual machine; this file uses nothing glibc-only). The edge spawns it as
 * root with the agent's listening socket on fd 3, the agent binary on fd 4, the platform shell
 * on fd 5 and the set-up on fd 9: a sealed memfd written by backends/container/launcher.py from
 * the very OCI config the runc runtime gets (bundle.py), translated into a flat list of records
 * whose fields are NUL-terminated strings (paths may hold any byte but NUL, so nothing needs
 * quoting; no JSON parser in a root process). Policy (which mounts, uid range, cgroup files,
 * capabilities, the seccomp program compiled by libseccomp) is all Python's; this file only
 * carries it out, in libcontainer's documented order:
 *
 *   parent (host namespaces, root):
 *     1. oom_score_adj (inherited), the sandbox's cgroup in every hierarchy (made, limits
 *        written), the network namespace rollbox made (joined: it is owned by the host's user
 *        namespace, so only before the new one),
 *     2. clone(user, mount, pid, ipc, uts namespaces): the child waits on a pipe,
 *     3. the child's pid into each cgroup's cgroup.procs, its uid_map and gid_map,
 *     4. "go"; then it reads the child's error pipe (close-on-exec): EOF with the child alive
 *        means the exec happened: the pid file is written, exit 0. A message: the child is
 *        killed and reaped, the cgroups it made removed (checked), the step and errno on
 *        stderr ("rollbox-launcher: STEP: MESSAGE (errno N)"), exit 1.
 *   child (pid 1 of the new pid namespace):
 *     5. uid/gid 0 of the sandbox, no groups, a new cgroup namespace (rooted at its cgroup),
 *        a new session, the hostname,
 *     6. / made private, the rootfs bound onto itself, each mount of config.json in order
 *        (targets resolved inside the rootfs: openat2 RESOLVE_IN_ROOT, no symlink followed,
 *        mounted through /proc/self/fd: the image can not send a mount elsewhere), the device
 *        nodes (host nodes bound: mknod is not allowed in a user namespace) and /dev symlinks,
 *     7. pivot_root, the old root detached, read-only paths, masked paths,
 *     8. rlimits, umask 022, no_new_privs, the capability sets (bounding dropped, effective/
 *        permitted/inheritable set, ambient raised), cwd, every fd past 5 closed on exec,
 *     9. seccomp last (the BPF program as given), then execveat(4, "", AT_EMPTY_PATH).
 * Failing at any step undoes everything: the child's namespaces (and so every mount it made)
 * die with it, the parent removes the cgroups it made; the netns, the rootfs and the pid file's
 * dir are the edge's to tear down, as with runc.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/mount.h>
#include <linux/openat2.h>
#include <linux/seccomp.h>

#define SPEC_FD 9 /* above the agent's fds (3-5, and 6: its optional platform-tool fd) */
#define KEEP_FDS 6 /* 0-2 stdio, 3 listener, 4 agent, 5 platform shell */
#define MAX_SPEC (1 << 20)
#define MAX_ITEMS 256
#define MAX_ARGS 64

#ifndef CLOSE_RANGE_CLOEXEC
#define CLOSE_RANGE_CLOEXEC (1U << 2)
#endif
#ifndef PR_CAP_AMBIENT
#define PR_CAP_AMBIENT 47
#define PR_CAP_AMBIENT_RAISE 2
#define PR_CAP_AMBIENT_CLEAR_ALL 4
#endif

struct mnt { const char *dest, *type, *src, *data; unsigned long flags; int subdir; mode_t mode; };
struct cg { const char *dir; int made; };
struct kv { const char *a, *b; };
struct rl { int res; unsigned long long soft, hard; };

static struct mnt mounts[MAX_ITEMS];
static int nmounts;
static struct cg cgroups_[MAX_ITEMS];
static int ncgroups;
static struct kv cgsets[MAX_ITEMS], devices[MAX_ITEMS], symlinks[MAX_ITEMS];
static int ncgsets, ndevices, nsymlinks;
static const char *masked[MAX_ITEMS], *readonly_[MAX_ITEMS];
static int nmasked, nreadonly;
static struct rl rlimits[16];
static int nrlimits;
static const char *args[MAX_ARGS + 1], *envs[MAX_ARGS + 1];
static int nargs, nenvs;
static const char *root, *pidfile, *netns, *hostname, *uid_map, *gid_map, *cwd = "/";
static const char *mask_dir; /* the node's empty read-only dir bound over masked dirs */
static int mask_tree = -1; /* its detached clone (open_tree), taken before pivot_root */
static unsigned long propagation = MS_REC | MS_PRIVATE;
static int oom_score_adj = 0, have_oom = 0, nnp = 0, exec_fd = 4;
static uint64_t cap_bnd, cap_eff, cap_prm, cap_inh, cap_amb;
static int have_caps;
static unsigned char *bpf;
static size_t bpf_len;
static int err_pipe = -1; /* child -> parent: the failing step */
static const char *step = "spec";
static void undo_cgroups(char *msg, size_t cap);

/* "STEP: MESSAGE (errno N)": to the parent (child) or stderr (parent), then exit. */
__attribute__((noreturn, format(printf, 2, 3)))
static void fail(int err, const char *fmt, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    int n = snprintf(buf, sizeof buf, "%s: ", step);
    if (n < 0) n = 0;
    int m = vsnprintf(buf + n, sizeof buf - n, fmt, ap);
    va_end(ap);
    if (m > 0) n += m;
    if (n > (int)sizeof buf - 64) n = sizeof buf - 64;
    n += snprintf(buf + n, sizeof buf - n, ": %s (errno %d)\n", strerror(err), err);
    if (err_pipe >= 0) {
        ssize_t w = write(err_pipe, buf, n);
        (void)w;
        _exit(127);
    }
    /* the parent fails only before the clone: nothing but cgroups to undo */
    char left[1024] = "";
    undo_cgroups(left, sizeof left);
    ssize_t w = write(2, "rollbox-launcher: ", 18);
    w = write(2, buf, n);
    w = write(2, left, strlen(left));
    (void)w;
    exit(1);
}
#define DIE(...) fail(errno, __VA_ARGS__)

/* ---- the spec ------------------------------------------------------------------------- */
static char *spec, *cur, *end;

static const char *field(void) {
    if (cur >= end) fail(EINVAL, "truncated record");
    char *s = cur;
    char *z = memchr(cur, 0, end - cur);
    if (!z) fail(EINVAL, "unterminated field");
    cur = z + 1;
    return s;
}

static unsigned long long num(const char *s) {
    char *e;
    errno = 0;
    unsigned long long v = strtoull(s, &e, 0);
    if (errno || !*s || *e) fail(EINVAL, "bad number %.40s", s);
    return v;
}

static void room(int n, int max, const char *what) {
    if (n >= max) fail(E2BIG, "too many %s", what);
}
#define PUSH(arr, n, max) (room((n), (max), #arr), &(arr)[(n)++])

static void read_spec(void) {
    struct stat st;
    if (fstat(SPEC_FD, &st)) DIE("fd %d", SPEC_FD);
    if (st.st_size <= 0 || st.st_size > MAX_SPEC) fail(EINVAL, "size %lld", (long long)st.st_size);
    spec = malloc(st.st_size + 1);
    if (!spec) DIE("malloc");
    size_t got = 0;
    while (got < (size_t)st.st_size) {
        ssize_t r = pread(SPEC_FD, spec + got, st.st_size - got, got);
        if (r <= 0) fail(r ? errno : EIO, "read");
        got += r;
    }
    close(SPEC_FD);
    cur = spec;
    end = spec + got;
    while (cur < end) {
        const char *op = field();
        if (!strcmp(op, "root")) root = field();
        else if (!strcmp(op, "pidfile")) pidfile = field();
        else if (!strcmp(op, "netns")) netns = field();
        else if (!strcmp(op, "hostname")) hostname = field();
        else if (!strcmp(op, "uid_map")) uid_map = field();
        else if (!strcmp(op, "gid_map")) gid_map = field();
        else if (!strcmp(op, "cwd")) cwd = field();
        else if (!strcmp(op, "propagation")) propagation = num(field());
        else if (!strcmp(op, "oom_score_adj")) { oom_score_adj = (int)num(field()); have_oom = 1; }
        else if (!strcmp(op, "no_new_privs")) nnp = 1;
        else if (!strcmp(op, "cgroup")) PUSH(cgroups_, ncgroups, MAX_ITEMS)->dir = field();
        else if (!strcmp(op, "cgset")) {
            struct kv *k = PUSH(cgsets, ncgsets, MAX_ITEMS);
            k->a = field();
            k->b = field();
        } else if (!strcmp(op, "mount")) {
            struct mnt *m = PUSH(mounts, nmounts, MAX_ITEMS);
            m->dest = field();
            m->type = field();
            m->src = field();
            m->flags = num(field());
            m->data = field();
        } else if (!strcmp(op, "subdir")) {
            struct mnt *m = PUSH(mounts, nmounts, MAX_ITEMS);
            m->dest = field();
            m->flags = num(field());
            m->mode = (mode_t)num(field());
            m->subdir = 1;
            m->type = m->src = m->data = "";
        } else if (!strcmp(op, "mask_dir")) mask_dir = field();
        else if (!strcmp(op, "device")) {
            struct kv *k = PUSH(devices, ndevices, MAX_ITEMS);
            k->a = field();
            k->b = field();
        } else if (!strcmp(op, "symlink")) {
            struct kv *k = PUSH(symlinks, nsymlinks, MAX_ITEMS);
            k->a = field();
            k->b = field();
        } else if (!strcmp(op, "masked")) *PUSH(masked, nmasked, MAX_ITEMS) = field();
        else if (!strcmp(op, "readonly")) *PUSH(readonly_, nreadonly, MAX_ITEMS) = field();
        else if (!strcmp(op, "rlimit")) {
            struct rl *r = PUSH(rlimits, nrlimits, 16);
            r->res = (int)num(field());
            r->soft = num(field());
            r->hard = num(field());
        } else if (!strcmp(op, "caps")) {
            cap_bnd = num(field());
            cap_eff = num(field());
            cap_prm = num(field());
            cap_inh = num(field());
            cap_amb = num(field());
            have_caps = 1;
        } else if (!strcmp(op, "arg")) *PUSH(args, nargs, MAX_ARGS) = field();
        else if (!strcmp(op, "env")) *PUSH(envs, nenvs, MAX_ARGS) = field();
        else if (!strcmp(op, "exec_fd")) exec_fd = (int)num(field());
        else if (!strcmp(op, "seccomp")) {
            bpf_len = num(field());
            if (bpf_len == 0 || bpf_len % sizeof(struct sock_filter) ||
                bpf_len > (size_t)(end - cur) || bpf_len / sizeof(struct sock_filter) > 4096)
                fail(EINVAL, "seccomp program of %zu bytes", bpf_len);
            bpf = (unsigned char *)cur;
            cur += bpf_len;
        } else fail(EINVAL, "unknown record %.40s", op);
    }
    if (!root || !pidfile || !uid_map || !gid_map || nargs == 0 || exec_fd < 3 ||
        exec_fd >= KEEP_FDS)
        fail(EINVAL, "incomplete spec");
    args[nargs] = NULL;
    envs[nenvs] = NULL;
}

/* ---- parent: cgroups ------------------------------------------------------------------- */
static int write_file(const char *path, const char *value, int flags) {
    int fd = open(path, O_WRONLY | O_CLOEXEC | flags, 0600);
    if (fd < 0) return -1;
    size_t len = strlen(value);
    ssize_t w = write(fd, value, len);
    int err = errno;
    close(fd);
    if (w != (ssize_t)len) {
        errno = w < 0 ? err : EIO;
        return -1;
    }
    return 0;
}

/* A v1 cpuset starts with no cpus and mems: copy them down from the parent (as runc does). */
static void cpuset_inherit(const char *dir) {
    char path[4096], parent[4096], val[4096];
    const char *files[] = {"cpuset.cpus", "cpuset.mems"};
    for (int i = 0; i < 2; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, files[i]);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0) return; /* not a cpuset hierarchy */
        ssize_t n = read(fd, val, sizeof val - 1);
        close(fd);
        if (n > 1) continue;
        snprintf(parent, sizeof parent, "%s", dir);
        char *slash = strrchr(parent, '/');
        if (!slash) continue;
        snprintf(slash, sizeof parent - (slash - parent), "/%s", files[i]);
        fd = open(parent, O_RDONLY | O_CLOEXEC);
        if (fd < 0) DIE("open %s", parent);
        n = read(fd, val, sizeof val - 1);
        close(fd);
        if (n < 0) DIE("read %s", parent);
        val[n] = 0;
        if (write_file(path, val, 0)) DIE("write %s", path);
    }
}

static void make_cgroups(void) {
    step = "cgroup";
    for (int i = 0; i < ncgroups; i++) {
        char buf[4096];
        const char *dir = cgroups_[i].dir;
        if (strncmp(dir, "/sys/fs/cgroup/", 15) || strstr(dir, "..") || strlen(dir) >= sizeof buf)
            fail(EINVAL, "cgroup %s", dir);
        strcpy(buf, dir);
        /* parents (shared by every sandbox, left in place) below /sys/fs/cgroup/<hierarchy>;
         * a v1 cpuset parent is filled in also when another launcher made it: that one may
         * not have copied its cpus and mems yet (two first creates of a node at once), and a
         * sandbox's cpuset copied from an empty parent refuses its init (ENOSPC at placement).
         * cpuset_inherit writes only what is empty, the same values whoever writes them. */
        char *p = strchr(buf + strlen("/sys/fs/cgroup/"), '/');
        for (; p; p = strchr(p + 1, '/')) {
            *p = 0;
            if (mkdir(buf, 0755) && errno != EEXIST) DIE("mkdir %s", buf);
            cpuset_inherit(buf);
            *p = '/';
        }
        if (mkdir(dir, 0755) == 0) cgroups_[i].made = 1;
        else if (errno != EEXIST) DIE("mkdir %s", dir);
        cpuset_inherit(dir);
    }
    for (int i = 0; i < ncgsets; i++)
        if (write_file(cgsets[i].a, cgsets[i].b, 0)) DIE("write %s = %s", cgsets[i].a, cgsets[i].b);
}

/* After a failure, the child reaped: rmdir what this launcher made; what stays is named. */
static void undo_cgroups(char *msg, size_t cap) {
    for (int i = ncgroups - 1; i >= 0; i--) {
        if (!cgroups_[i].made) continue;
        int tries = 0;
        while (rmdir(cgroups_[i].dir) && errno == EBUSY && tries++ < 100) usleep(1000);
        if (access(cgroups_[i].dir, F_OK) == 0) {
            size_t l = strlen(msg);
            snprintf(msg + l, cap - l, "rollbox-launcher: cleanup: cgroup %s left\n",
                     cgroups_[i].dir);
        }
    }
}

/* ---- child: mounts inside the rootfs ----------------------------------------------------- */
static int rootfd = -1;

/* No symlink is followed at all: every target is a top-level dir of the image (/proc, /dev,
 * /sys: a symlink there is refused, as runc refuses one at /proc) or inside a filesystem this
 * launcher has just mounted. */
static int resolve(const char *path, int flags) {
    struct open_how how = {.flags = flags | O_CLOEXEC,
                           .resolve = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS |
                                      RESOLVE_NO_SYMLINKS};
    return (int)syscall(SYS_openat2, rootfd, path, &how, sizeof how);
}

/* An O_PATH fd of PATH inside the rootfs, made (parents as dirs, itself as a dir or an
 * empty file) where missing; every component resolved with the rootfs as "/", no symlink. */
static int target(const char *path, int dir) {
    char buf[4096];
    if (path[0] != '/' || strlen(path) >= sizeof buf) fail(EINVAL, "path %s", path);
    int fd = resolve(path, O_PATH);
    if (fd >= 0) return fd;
    if (errno != ENOENT) DIE("resolve %s", path);
    strcpy(buf, path);
    char *last = strrchr(buf, '/');
    *last = 0;
    int parent = buf[0] ? target(buf, 1) : dup(rootfd);
    if (parent < 0) DIE("open /");
    const char *name = last + 1;
    if (dir) {
        if (mkdirat(parent, name, 0755) && errno != EEXIST) DIE("mkdir %s", path);
    } else {
        int f = openat(parent, name, O_WRONLY | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0644);
        if (f < 0 && errno != EEXIST) DIE("create %s", path);
        if (f >= 0) close(f);
    }
    close(parent);
    fd = resolve(path, O_PATH);
    if (fd < 0) DIE("resolve %s", path);
    return fd;
}

static void fdpath(char *buf, size_t cap, int fd) { snprintf(buf, cap, "/proc/self/fd/%d", fd); }

/* The flags a remount in a user namespace must keep (they are locked from the host). */
static unsigned long locked_flags(const char *path) {
    struct statvfs s;
    if (statvfs(path, &s)) DIE("statvfs %s", path);
    unsigned long f = 0;
    if (s.f_flag & ST_NOSUID) f |= MS_NOSUID;
    if (s.f_flag & ST_NODEV) f |= MS_NODEV;
    if (s.f_flag & ST_NOEXEC) f |= MS_NOEXEC;
    if (s.f_flag & ST_NOATIME) f |= MS_NOATIME;
    if (s.f_flag & ST_NODIRATIME) f |= MS_NODIRATIME;
    if (s.f_flag & ST_RELATIME) f |= MS_RELATIME;
    return f;
}

/* A directory of the filesystem just mounted at its parent, bound onto itself with its own
 * flags: a mount point without a superblock of its own (launcher.py: /dev/shm). */
static void make_subdir(const struct mnt *m) {
    char tp[64];
    int fd = target(m->dest, 1);
    fdpath(tp, sizeof tp, fd);
    if (chmod(tp, m->mode)) DIE("chmod %s", m->dest);
    if (mount(tp, tp, NULL, MS_BIND, NULL)) DIE("bind %s", m->dest);
    close(fd);
    fd = resolve(m->dest, O_PATH);
    if (fd < 0) DIE("resolve %s", m->dest);
    fdpath(tp, sizeof tp, fd);
    if (mount(NULL, tp, NULL, MS_BIND | MS_REMOUNT | m->flags | locked_flags(tp), NULL))
        DIE("remount %s", m->dest);
    close(fd);
}

static void do_mount(const struct mnt *m) {
    char tp[64];
    step = "mount";
    if (m->subdir) {
        make_subdir(m);
        return;
    }
    int bind = (m->flags & MS_BIND) != 0;
    int isdir = 1;
    int srcfd = -1;
    if (bind) {
        struct stat st;
        srcfd = open(m->src, O_PATH | O_CLOEXEC);
        if (srcfd < 0 || fstat(srcfd, &st)) DIE("bind source %s for %s", m->src, m->dest);
        isdir = S_ISDIR(st.st_mode);
    }
    int fd = target(m->dest, isdir);
    fdpath(tp, sizeof tp, fd);
    if (bind) {
        char sp[64];
        fdpath(sp, sizeof sp, srcfd);
        if (mount(sp, tp, NULL, MS_BIND | (m->flags & MS_REC), NULL))
            DIE("bind %s at %s", m->src, m->dest);
        unsigned long extra = m->flags & ~(MS_BIND | MS_REC);
        if (extra) {
            close(fd);
            fd = resolve(m->dest, O_PATH);
            if (fd < 0) DIE("resolve %s", m->dest);
            fdpath(tp, sizeof tp, fd);
            if (mount(NULL, tp, NULL, MS_BIND | MS_REMOUNT | extra | locked_flags(tp), NULL))
                DIE("remount %s", m->dest);
        }
        close(srcfd);
    } else {
        /* a read-only tmpfs with mounts below it: mounted writable, made read-only by a
         * readonly record after them (bundle.py), as runc needs too */
        if (mount(m->src, tp, m->type, m->flags, m->data[0] ? m->data : NULL))
            DIE("%s at %s", m->type, m->dest);
    }
    close(fd);
}

static void make_devices(void) {
    step = "devices";
    for (int i = 0; i < ndevices; i++) {
        struct mnt m = {.dest = devices[i].a, .type = "bind", .src = devices[i].b,
                        .flags = MS_BIND, .data = ""};
        do_mount(&m);
    }
    for (int i = 0; i < nsymlinks; i++) {
        char buf[4096];
        const char *link = symlinks[i].b;
        if (link[0] != '/' || strlen(link) >= sizeof buf) fail(EINVAL, "symlink %s", link);
        strcpy(buf, link);
        char *last = strrchr(buf, '/');
        *last = 0;
        int dir = buf[0] ? target(buf, 1) : dup(rootfd);
        if (dir < 0) DIE("symlink %s", link);
        if (symlinkat(symlinks[i].a, dir, last + 1) && errno != EEXIST) DIE("symlink %s", link);
        close(dir);
    }
}

static void prepare_root(void) {
    step = "rootfs";
    if (mount(NULL, "/", NULL, propagation, NULL)) DIE("propagation of /");
    if (mount(root, root, NULL, MS_BIND | MS_REC, NULL)) DIE("bind %s", root);
    rootfd = open(root, O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (rootfd < 0) DIE("open %s", root);
    for (int i = 0; i < nmounts; i++) do_mount(&mounts[i]);
    make_devices();
    if (mask_dir) {
        /* the node's mask reached by its host path while that is still in this namespace;
         * after pivot_root each masked dir gets a clone of this detached copy */
        step = "masked paths";
        mask_tree = (int)syscall(SYS_open_tree, AT_FDCWD, mask_dir,
                                 OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC);
        if (mask_tree < 0) DIE("open_tree %s", mask_dir);
        struct mount_attr attr = {.attr_set = MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID |
                                              MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC};
        if (syscall(SYS_mount_setattr, mask_tree, "", AT_EMPTY_PATH, &attr, sizeof attr))
            DIE("mount_setattr %s", mask_dir);
    }
    step = "pivot_root";
    if (fchdir(rootfd)) DIE("chdir %s", root);
    if (syscall(SYS_pivot_root, ".", ".")) DIE("pivot_root");
    if (mount(NULL, ".", NULL, MS_SLAVE | MS_REC, NULL)) DIE("old root slave");
    if (umount2(".", MNT_DETACH)) DIE("detach old root");
    if (chdir("/")) DIE("chdir /");
    close(rootfd);
}

/* After pivot_root: paths resolve inside the sandbox's root (a symlink can not leave it). */
static void readonly_path(const char *path) {
    if (mount(path, path, NULL, MS_BIND | MS_REC, NULL)) {
        if (errno == ENOENT) return;
        DIE("bind %s", path);
    }
    if (mount(NULL, path, NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | locked_flags(path), NULL))
        DIE("read-only %s", path);
}

static void mask_path(const char *path) {
    if (mount("/dev/null", path, NULL, MS_BIND, NULL) == 0) return;
    if (errno == ENOENT) return;
    if (errno != ENOTDIR) DIE("mask %s", path);
    if (mask_tree < 0) {
        if (mount("tmpfs", path, "tmpfs", MS_RDONLY, NULL)) DIE("mask dir %s", path);
        return;
    }
    /* a directory: a read-only bind of the node's empty mask (no superblock of its own) */
    int t = (int)syscall(SYS_open_tree, mask_tree, "",
                         OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_EMPTY_PATH);
    if (t < 0) DIE("clone the mask for %s", path);
    if (syscall(SYS_move_mount, t, "", AT_FDCWD, path,
                MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_SYMLINKS)) /* as mount(2) */
        DIE("mask dir %s", path);
    close(t);
}

static void set_caps(int last_cap) {
    step = "capabilities";
    for (int c = 0; c <= last_cap; c++)
        if (!(cap_bnd >> c & 1) && prctl(PR_CAPBSET_DROP, c, 0, 0, 0)) DIE("drop cap %d", c);
    struct __user_cap_header_struct h = {.version = _LINUX_CAPABILITY_VERSION_3, .pid = 0};
    struct __user_cap_data_struct d[2] = {
        {(uint32_t)cap_eff, (uint32_t)cap_prm, (uint32_t)cap_inh},
        {(uint32_t)(cap_eff >> 32), (uint32_t)(cap_prm >> 32), (uint32_t)(cap_inh >> 32)}};
    if (syscall(SYS_capset, &h, d)) DIE("capset");
    if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)) DIE("clear ambient");
    for (int c = 0; c <= last_cap; c++)
        if ((cap_amb >> c & 1) && prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, c, 0, 0))
            DIE("ambient cap %d", c);
}

static void load_seccomp(void) {
    step = "seccomp";
    struct sock_fprog prog = {.len = (unsigned short)(bpf_len / sizeof(struct sock_filter)),
                              .filter = (struct sock_filter *)bpf};
    /* the program is copied out of the (unaligned) spec buffer first */
    struct sock_filter *copy = malloc(bpf_len);
    if (!copy) DIE("malloc");
    memcpy(copy, bpf, bpf_len);
    prog.filter = copy;
    if (syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &prog)) DIE("load filter");
}

static void child(int go_fd, int last_cap) {
    char c;
    ssize_t r;
    step = "wait for the parent";
    do r = read(go_fd, &c, 1); while (r < 0 && errno == EINTR);
    if (r != 1) _exit(126); /* the parent failed and says why */
    close(go_fd);
    step = "identity";
    if (setresgid(0, 0, 0)) DIE("setresgid");
    if (setgroups(0, NULL)) DIE("setgroups");
    if (setresuid(0, 0, 0)) DIE("setresuid");
    if (unshare(CLONE_NEWCGROUP)) DIE("cgroup namespace");
    if (setsid() < 0) DIE("setsid");
    if (hostname && sethostname(hostname, strlen(hostname))) DIE("sethostname");
    prepare_root();
    step = "readonly paths";
    for (int i = 0; i < nreadonly; i++) readonly_path(readonly_[i]);
    step = "masked paths";
    for (int i = 0; i < nmasked; i++) mask_path(masked[i]);
    if (mask_tree >= 0) close(mask_tree);
    step = "rlimits";
    for (int i = 0; i < nrlimits; i++) {
        struct rlimit l = {rlimits[i].soft, rlimits[i].hard};
        if (setrlimit(rlimits[i].res, &l)) DIE("rlimit %d", rlimits[i].res);
    }
    umask(022);
    step = "no_new_privs";
    if (nnp && prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)) DIE("prctl");
    if (bpf && !nnp) load_seccomp(); /* needs CAP_SYS_ADMIN (of the sandbox): before caps */
    if (have_caps) set_caps(last_cap);
    step = "cwd";
    if (chdir(cwd)) DIE("chdir %s", cwd);
    step = "fds";
    if (syscall(SYS_close_range, KEEP_FDS, ~0U, CLOSE_RANGE_CLOEXEC)) DIE("close_range");
    for (int fd = 3; fd < KEEP_FDS; fd++) {
        int fl = fcntl(fd, F_GETFD);
        if (fl < 0 || fcntl(fd, F_SETFD, fl & ~FD_CLOEXEC)) DIE("fd %d", fd);
    }
    /* every signal unblocked and at its default (an ignored one would outlive the exec; the
     * raw call also reaches the two the C library keeps for itself) */
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    for (int sig = 1; sig <= 64; sig++) {
        struct { void *handler; unsigned long flags; void *restorer; uint64_t mask; } dfl = {0};
        if (sig != SIGKILL && sig != SIGSTOP)
            syscall(SYS_rt_sigaction, sig, &dfl, NULL, sizeof dfl.mask);
    }
    if (bpf && nnp) load_seccomp();
    step = "exec";
    syscall(SYS_execveat, exec_fd, "", (char *const *)args, (char *const *)envs, AT_EMPTY_PATH);
    DIE("execveat fd %d", exec_fd);
}

static int read_last_cap(void) {
    char buf[16] = {0};
    int fd = open("/proc/sys/kernel/cap_last_cap", O_RDONLY | O_CLOEXEC);
    if (fd < 0 || read(fd, buf, sizeof buf - 1) <= 0) DIE("cap_last_cap");
    close(fd);
    return atoi(buf);
}

int main(void) {
    /* everything this process opens is close-on-exec: the agent gets fds 0-5 only */
    for (int fd = 0; fd < KEEP_FDS; fd++)
        if (fcntl(fd, F_GETFD) < 0) DIE("fd %d not given", fd);
    read_spec();
    int last_cap = read_last_cap();
    if (have_oom) {
        step = "oom_score_adj";
        char v[16];
        snprintf(v, sizeof v, "%d", oom_score_adj);
        if (write_file("/proc/self/oom_score_adj", v, 0)) DIE("write");
    }
    make_cgroups();
    unsigned long flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS;
    if (netns) {
        step = "network namespace";
        int fd = open(netns, O_RDONLY | O_CLOEXEC);
        if (fd < 0) DIE("open %s", netns);
        if (setns(fd, CLONE_NEWNET)) DIE("setns %s", netns);
        close(fd);
    }
    int go[2], errp[2];
    if (pipe2(go, O_CLOEXEC) || pipe2(errp, O_CLOEXEC)) DIE("pipe");
    step = "clone";
    pid_t pid = (pid_t)syscall(SYS_clone, flags | SIGCHLD, NULL, NULL, NULL, NULL);
    if (pid < 0) DIE("namespaces");
    if (pid == 0) {
        close(go[1]);
        close(errp[0]);
        err_pipe = errp[1];
        child(go[0], last_cap);
    }
    close(go[0]);
    close(errp[1]);
    /* from here a failure of the parent kills the child first (its namespaces go with it) */
    char msg[2048] = "";
    size_t got = 0;
    int perr = 0;
    const char *pstep = NULL;
    {
        /* the parent's part: cgroups (before the child runs anything), uid and gid maps */
        char path[64];
        snprintf(path, sizeof path, "%d", (int)pid);
        char val[32];
        snprintf(val, sizeof val, "%d", (int)pid);
        step = "cgroup placement";
        for (int i = 0; i < ncgroups && !perr; i++) {
            char p[4096];
            snprintf(p, sizeof p, "%s/cgroup.procs", cgroups_[i].dir);
            if (write_file(p, val, 0)) { perr = errno; pstep = "cgroup placement"; }
        }
        if (!perr) {
            snprintf(path, sizeof path, "/proc/%d/uid_map", (int)pid);
            if (write_file(path, uid_map, 0)) { perr = errno; pstep = "uid_map"; }
        }
        if (!perr) {
            snprintf(path, sizeof path, "/proc/%d/gid_map", (int)pid);
            if (write_file(path, gid_map, 0)) { perr = errno; pstep = "gid_map"; }
        }
        if (!perr && write(go[1], "g", 1) != 1) { perr = errno; pstep = "release the child"; }
    }
    close(go[1]);
    if (!perr) {
        ssize_t r;
        while ((r = read(errp[0], msg + got, sizeof msg - 1 - got)) != 0) {
            if (r < 0 && errno == EINTR) continue;
            if (r < 0) break;
            got += r;
            if (got >= sizeof msg - 1) break;
        }
        msg[got] = 0;
    }
    close(errp[0]);
    int status = 0;
    if (!perr && got == 0) {
        /* EOF: the exec closed the pipe, or the child died before a word */
        pid_t w = waitpid(pid, &status, WNOHANG);
        if (w == 0) {
            step = "pid file";
            char v[32];
            snprintf(v, sizeof v, "%d\n", (int)pid);
            if (write_file(pidfile, v, O_CREAT | O_TRUNC) == 0) return 0;
            perr = errno;
            pstep = "pid file";
        } else {
            snprintf(msg, sizeof msg, "exec: the sandbox's init died at its start (status 0x%x) "
                     "(errno %d)\n", status, ESRCH);
        }
    }
    kill(pid, SIGKILL);
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
    size_t l = strlen(msg);
    if (perr)
        snprintf(msg + l, sizeof msg - l, "%s: %s (errno %d)\n", pstep, strerror(perr), perr);
    undo_cgroups(msg, sizeof msg);
    l = strlen(msg);
    ssize_t w = write(2, "rollbox-launcher: ", 18);
    w = write(2, msg, l);
    (void)w;
    return 1;
}
