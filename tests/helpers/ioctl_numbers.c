/* Prints "NAME 0xNUMBER" for every ioctl the seccomp profile refuses, as the kernel's headers
 * define it. Where the installed uapi headers predate an ioctl (XFS exchange-range and commit
 * came in Linux 6.10/6.13, after Debian's xfslibs-dev 6.1), its struct and number are copied
 * verbatim from the kernel's fs/xfs/libxfs/xfs_fs.h and computed with the headers' _IOW/_IOR,
 * so a struct size or direction written by hand elsewhere can't drift unnoticed. */
#include <stdio.h>
#include <sys/ioctl.h>
#include <linux/fs.h>
#include <linux/btrfs.h>
#include <linux/ioctl.h>
#include <linux/types.h>
#include <xfs/xfs.h>

#ifndef XFS_IOC_EXCHANGE_RANGE
struct xfs_exchange_range {
	__s32		file1_fd;
	__u32		pad;		/* must be zeroes */
	__u64		file1_offset;	/* file1 offset, bytes */
	__u64		file2_offset;	/* file2 offset, bytes */
	__u64		length;		/* bytes to exchange */

	__u64		flags;		/* see XFS_EXCHANGE_RANGE_* below */
};
#define XFS_IOC_EXCHANGE_RANGE	     _IOW ('X', 129, struct xfs_exchange_range)
#endif
#ifndef XFS_IOC_COMMIT_RANGE
struct xfs_commit_range {
	__s32		file1_fd;
	__u32		pad;		/* must be zeroes */
	__u64		file1_offset;	/* file1 offset, bytes */
	__u64		file2_offset;	/* file2 offset, bytes */
	__u64		length;		/* bytes to exchange */

	__u64		flags;		/* see XFS_EXCHANGE_RANGE_* below */

	/* opaque file2 metadata for freshness checks */
	__u64		file2_freshness[6];
};
#define XFS_IOC_START_COMMIT	     _IOR ('X', 130, struct xfs_commit_range)
#define XFS_IOC_COMMIT_RANGE	     _IOW ('X', 131, struct xfs_commit_range)
#endif

#define P(name) printf("%s 0x%08lx\n", #name, (unsigned long)(unsigned int)(name))

int main(void) {
	P(FICLONE); P(FICLONERANGE); P(FIDEDUPERANGE);
	P(BTRFS_IOC_CLONE); P(BTRFS_IOC_CLONE_RANGE); P(BTRFS_IOC_FILE_EXTENT_SAME);
	P(XFS_IOC_SWAPEXT); P(XFS_IOC_EXCHANGE_RANGE); P(XFS_IOC_START_COMMIT);
	P(XFS_IOC_COMMIT_RANGE);
	P(TIOCSTI); P(TIOCLINUX);
	P(BTRFS_IOC_SUBVOL_CREATE); P(BTRFS_IOC_SUBVOL_CREATE_V2); P(BTRFS_IOC_SNAP_CREATE);
	P(BTRFS_IOC_SNAP_CREATE_V2); P(BTRFS_IOC_SNAP_DESTROY); P(BTRFS_IOC_SNAP_DESTROY_V2);
	return 0;
}
