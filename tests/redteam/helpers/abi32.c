/* Red-team helper (built on the host with gcc -static, run inside a sandbox): issue getpid via
 * the i386 ABI (int 0x80) or the x32 ABI (nr | 0x40000000) and print what came back. A filter
 * that only knows x86_64 numbers would let these through; the profile must refuse both. */
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include <sys/syscall.h>

int main(int argc, char **argv)
{
    long r = -1;
    if (argc > 1 && !strcmp(argv[1], "int80")) {
        __asm__ volatile("int $0x80" : "=a"(r) : "a"(20L) : "memory"); /* i386 getpid */
    } else if (argc > 1 && !strcmp(argv[1], "x32")) {
        r = syscall(0x40000000L | 39); /* x32 getpid */
    } else {
        r = getpid();
    }
    printf("%ld\n", r);
    return 0;
}
