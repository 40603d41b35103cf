/* rollbox-jailer: start one program (QEMU) jailed for a microVM sandbox.
 *
 * Shaped after Firecracker's jailer (not copied): the edge runs it as root with everything
 * decided on its command line; it
 *   0. with --sched idle, takes the SCHED_IDLE policy (passed on to the program and its
 *      threads: a batch sandbox's QEMU, or a spare QEMU started ahead of its sandbox, which
 *      the edge sets to its sandbox's class at claim),
 *   1. joins the sandbox's cgroups (--cgroup DIR, one per hierarchy: limits + cgroup.kill),
 *   2. joins the sandbox's network namespace (--netns PATH) or makes an empty one,
 *   3. unshares pid, mount, ipc and uts namespaces,
 *   4. builds a new root on a tmpfs mounted over --root DIR (inside the new mount namespace
 *      only: the host never sees these mounts): /usr read-only, the lib/bin symlinks of a
 *      merged-/usr system, /proc of the new pid namespace (pids only), a /dev with only null
 *      and the device nodes named by --dev (made with the host's numbers, owned by --uid), and
 *      each --ro/--rw SRC:DST bind at its fixed path (e.g. /vm/kernel), then
 *      pivot_root()s into it,
 *   5. forks: the child is PID 1 of the new pid namespace; it drops to --uid/--gid with no
 *      supplementary groups, an empty capability bounding set, no_new_privs, a new session,
 *      RLIMIT_CORE, RLIMIT_NICE and RLIMIT_RTPRIO 0, no transparent huge pages, an empty environment, only fds 0-2 and
 *      3..3+--keep-fds-1 open, and execs the program;
 *   6. the parent writes the child's host pid to --pidfile and exits 0 once the exec happened
 *      (or 1 with the failing step on stderr). The program then runs on its own (the edge, a
 *      child subreaper, reaps it).
 *
 * Everything comes from the edge; nothing is read from the sandbox. Owns no policy: which
 * files, uid, cgroups and namespaces a VM gets is backends/microvm/jail.py's call.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>
#include <linux/capability.h>
#include <grp.h>

#define MAX_ITEMS 64

struct bind { const char *src; char *dst; int rw; };

static struct bind binds[MAX_ITEMS];
static int nbinds;
static const char *devs[MAX_ITEMS];
static int ndevs;
static const char *cgroups_[MAX_ITEMS];
static int ncgroups;
static int err_pipe = -1; /* child -> parent: why a step failed */

static void die(const char *fmt, ...) {
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof buf - 2, fmt, ap);
    va_end(ap);
    if (n < 0) n = 0;
    if (n > (int)sizeof buf - 2) n = sizeof buf - 2;
    n += snprintf(buf + n, sizeof buf - n, ": %s\n", strerror(errno));
    if (n > (int)sizeof buf) n = sizeof buf;
    if (err_pipe >= 0) {
        ssize_t w = write(err_pipe, buf, n);
        (void)w;
        _exit(127);
    }
    ssize_t w = write(2, "rollbox-jailer: ", 16);
    w = write(2, buf, n);
    (void)w;
    exit(1);
}

static void usage(void) {
    errno = EINVAL;
    die("usage: rollbox-jailer --root DIR --uid N --gid N --pidfile PATH [--cgroup DIR]... "
        "[--netns PATH] [--ro SRC:DST]... [--rw SRC:DST]... [--dev PATH]... [--keep-fds N] "
        "[--sched idle|normal] "
        "-- PROGRAM ARGS...");
}

static long parse_num(const char *s) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || *end || v < 0) usage();
    return v;
}

/* mkdir -p of an absolute path below the new root (cwd is the new root). */
static void make_parents(const char *path, mode_t mode) {
    char buf[4096];
    if (strlen(path) >= sizeof buf) { errno = ENAMETOOLONG; die("path %s", path); }
    strcpy(buf, path);
    for (char *p = buf + 1; *p; p++) {
        if (*p != '/') continue;
        *p = 0;
        if (mkdir(buf + 1, mode) && errno != EEXIST) die("mkdir %s", buf);
        *p = '/';
    }
}

static void bind_at(const char *src, const char *dst, unsigned long flags) {
    struct stat st;
    const char *rel = dst + 1; /* relative to the new root (cwd) */
    if (dst[0] != '/' || strstr(dst, "..")) { errno = EINVAL; die("destination %s", dst); }
    if (stat(src, &st)) die("stat %s", src);
    make_parents(dst, 0755);
    if (S_ISDIR(st.st_mode)) {
        if (mkdir(rel, 0755) && errno != EEXIST) die("mkdir %s", dst);
    } else {
        int fd = open(rel, O_WRONLY | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
        if (fd < 0) die("create %s", dst);
        close(fd);
    }
    if (mount(src, rel, NULL, MS_BIND | MS_REC, NULL)) die("bind %s at %s", src, dst);
    if (mount(NULL, rel, NULL, MS_BIND | MS_REMOUNT | flags, NULL))
        die("remount %s", dst);
}

static void join_cgroups(void) {
    char pid[32];
    int n = snprintf(pid, sizeof pid, "%d\n", getpid());
    for (int i = 0; i < ncgroups; i++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/cgroup.procs", cgroups_[i]);
        int fd = open(path, O_WRONLY | O_CLOEXEC);
        if (fd < 0) die("open %s", path);
        if (write(fd, pid, n) != n) die("join %s", cgroups_[i]);
        close(fd);
    }
}

/* /dev: its own small tmpfs (the root's is nodev) holding /dev/null (QEMU probes file locks
 * on it) and a node of each --dev device, made here with the host device's numbers and owned
 * by the jail's uid (the host's /dev/kvm is root-only); read-only once the root is pivoted. */
static void make_devices(uid_t uid, gid_t gid) {
    if (mkdir("dev", 0755)) die("mkdir /dev");
    if (mount("jaildev", "dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=16k,nr_inodes=32,mode=0755"))
        die("tmpfs at /dev");
    struct stat st;
    if (stat("/dev/null", &st) || !S_ISCHR(st.st_mode)) die("/dev/null");
    if (mknod("dev/null", S_IFCHR | 0666, st.st_rdev) || chmod("dev/null", 0666))
        die("mknod /dev/null");
    for (int i = 0; i < ndevs; i++) {
        const char *dev = devs[i];
        if (strncmp(dev, "/dev/", 5) || strstr(dev, "..")) { errno = EINVAL; die("device %s", dev); }
        if (stat(dev, &st) || !S_ISCHR(st.st_mode)) { errno = ENODEV; die("device %s", dev); }
        make_parents(dev, 0755);
        if (mknod(dev + 1, S_IFCHR | 0600, st.st_rdev) || chown(dev + 1, uid, gid))
            die("mknod %s", dev);
    }
}

static void build_root(const char *root, uid_t uid, gid_t gid) {
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL)) die("make / private");
    if (mount("jail", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=256,mode=0755"))
        die("tmpfs at %s", root);
    if (chdir(root)) die("chdir %s", root);
    bind_at("/usr", "/usr", MS_RDONLY | MS_NOSUID | MS_NODEV);
    /* merged-/usr: the dynamic loader and libraries are reached through these links */
    const char *links[][2] = {{"usr/lib", "lib"}, {"usr/lib64", "lib64"}, {"usr/bin", "bin"},
                              {"usr/sbin", "sbin"}};
    for (unsigned i = 0; i < sizeof links / sizeof links[0]; i++) {
        struct stat st;
        if (lstat(links[i][0], &st) == 0 && symlink(links[i][0], links[i][1]))
            die("symlink %s", links[i][1]);
    }
    make_devices(uid, gid);
    for (int i = 0; i < nbinds; i++)
        bind_at(binds[i].src, binds[i].dst,
                MS_NOSUID | MS_NODEV | MS_NOEXEC | (binds[i].rw ? 0 : MS_RDONLY));
    if (mkdir("proc", 0555)) die("mkdir /proc");
    if (mkdir(".old", 0700)) die("mkdir .old");
    if (syscall(SYS_pivot_root, ".", ".old")) die("pivot_root");
    if (chdir("/")) die("chdir /");
    if (umount2("/.old", MNT_DETACH)) die("umount old root");
    if (rmdir("/.old")) die("rmdir .old");
    /* the root tmpfs itself read-only: nothing in the jail can add files */
    if (mount(NULL, "/", NULL, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV, NULL))
        die("remount / read-only");
    if (mount(NULL, "/dev", NULL, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NOEXEC, NULL))
        die("remount /dev read-only");
}

static void drop_privileges(uid_t uid, gid_t gid) {
    for (int cap = 0; cap <= 63; cap++)
        if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) && errno != EINVAL) die("drop cap %d", cap);
    if (setgroups(0, NULL)) die("setgroups");
    if (setresgid(gid, gid, gid)) die("setgid %d", (int)gid);
    if (setresuid(uid, uid, uid)) die("setuid %d", (int)uid);
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)) die("no_new_privs");
    if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) && errno != EINVAL)
        die("clear ambient caps");
    struct rlimit zero = {0, 0};
    if (setrlimit(RLIMIT_CORE, &zero)) die("RLIMIT_CORE");
    /* no nice below 0 and no real-time policy (rollbox.isolation.qos RLIMITS): a QEMU at
     * SCHED_IDLE (a batch sandbox's) can not leave it */
    if (setrlimit(RLIMIT_NICE, &zero)) die("RLIMIT_NICE");
    if (setrlimit(RLIMIT_RTPRIO, &zero)) die("RLIMIT_RTPRIO");
    /* No transparent huge pages for QEMU (inherited across exec; QEMU's MADV_HUGEPAGE on guest
     * RAM is then ignored): a guest touching 4 KiB costs the host 4 KiB, not 2 MiB (an idle
     * 512 MiB busybox guest: 91 instead of 98 MiB of guest RAM resident). */
    if (prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0)) die("PR_SET_THP_DISABLE");
}

int main(int argc, char **argv) {
    const char *root = NULL, *netns = NULL, *pidfile = NULL;
    long uid = -1, gid = -1, keep_fds = 0;
    int sched_idle = 0;
    int i = 1;
    for (; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--")) { i++; break; }
        if (i + 1 >= argc) usage();
        const char *v = argv[++i];
        if (!strcmp(a, "--root")) root = v;
        else if (!strcmp(a, "--uid")) uid = parse_num(v);
        else if (!strcmp(a, "--gid")) gid = parse_num(v);
        else if (!strcmp(a, "--pidfile")) pidfile = v;
        else if (!strcmp(a, "--netns")) netns = v;
        else if (!strcmp(a, "--keep-fds")) keep_fds = parse_num(v);
        else if (!strcmp(a, "--sched") && (!strcmp(v, "idle") || !strcmp(v, "normal")))
            sched_idle = !strcmp(v, "idle");
        else if (!strcmp(a, "--cgroup") && ncgroups < MAX_ITEMS) cgroups_[ncgroups++] = v;
        else if (!strcmp(a, "--dev") && ndevs < MAX_ITEMS) devs[ndevs++] = v;
        else if ((!strcmp(a, "--ro") || !strcmp(a, "--rw")) && nbinds < MAX_ITEMS) {
            char *copy = strdup(v);
            char *colon = copy ? strchr(copy, ':') : NULL;
            if (!colon) usage();
            *colon = 0;
            binds[nbinds].src = copy;
            binds[nbinds].dst = colon + 1;
            binds[nbinds].rw = a[3] == 'w';
            nbinds++;
        } else usage();
    }
    if (!root || !pidfile || uid <= 0 || gid <= 0 || i >= argc || argv[i][0] != '/' ||
        keep_fds > 32)
        usage();
    char **prog = argv + i;

    if (sched_idle) {
        struct sched_param sp = {0};
        if (sched_setscheduler(0, SCHED_IDLE, &sp)) die("SCHED_IDLE");
    }
    join_cgroups();
    if (netns) {
        int fd = open(netns, O_RDONLY | O_CLOEXEC);
        if (fd < 0) die("open %s", netns);
        if (setns(fd, CLONE_NEWNET)) die("setns %s", netns);
        close(fd);
    } else if (unshare(CLONE_NEWNET)) {
        die("unshare net");
    }
    /* the pid namespace applies to the next child; the mount namespace is the child's own
     * (pivot_root moves the root of every process of a mount namespace, the parent's too) */
    if (unshare(CLONE_NEWPID)) die("unshare pid");

    int pipefd[2];
    if (pipe2(pipefd, O_CLOEXEC)) die("pipe");
    pid_t child = fork();
    if (child < 0) die("fork");
    if (child == 0) {
        close(pipefd[0]);
        err_pipe = pipefd[1];
        if (unshare(CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS)) die("unshare");
        if (sethostname("vm", 2)) die("sethostname");
        build_root(root, (uid_t)uid, (gid_t)gid);
        if (mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC,
                  "hidepid=2,subset=pid"))
            die("mount /proc");
        if (setsid() < 0) die("setsid");
        drop_privileges((uid_t)uid, (gid_t)gid);
        /* fds 0-2 and the kept ones stay (not close-on-exec), every other one is closed */
        for (int fd = 3; fd < 3 + keep_fds; fd++) {
            int flags = fcntl(fd, F_GETFD);
            if (flags < 0) die("kept fd %d", fd);
            if (fcntl(fd, F_SETFD, flags & ~FD_CLOEXEC)) die("fd %d", fd);
        }
        if (dup2(pipefd[1], 3 + keep_fds + 1) < 0) die("dup2");
        err_pipe = 3 + keep_fds + 1;
        if (fcntl(err_pipe, F_SETFD, FD_CLOEXEC)) die("cloexec");
        if (syscall(SYS_close_range, 3 + keep_fds, 3 + keep_fds, 0)) die("close_range");
        if (syscall(SYS_close_range, 3 + keep_fds + 2, ~0U, 0)) die("close_range");
        char *empty_env[] = {NULL};
        execve(prog[0], prog, empty_env);
        die("exec %s", prog[0]);
    }
    close(pipefd[1]);
    char buf[512];
    ssize_t n, total = 0;
    while ((n = read(pipefd[0], buf + total, sizeof buf - 1 - total)) > 0) total += n;
    if (total > 0) {
        buf[total] = 0;
        waitpid(child, NULL, 0);
        fprintf(stderr, "rollbox-jailer: %s", buf);
        return 1;
    }
    FILE *f = fopen(pidfile, "we");
    if (!f || fprintf(f, "%d\n", (int)child) < 0 || fclose(f)) {
        kill(child, SIGKILL);
        die("pidfile %s", pidfile);
    }
    return 0;
}
