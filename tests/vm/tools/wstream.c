// wstream: O_DIRECT writes through io_uring with a block-layer write stream.
//
// Linux 6.16 added `__u8 write_stream` at byte 44 of the io_uring SQE (a union
// with splice_fd_in/file_index/addr_len). Debian bookworm's uapi headers and
// liburing 2.3 have no field for it, so this program uses raw io_uring syscalls
// and sets the byte by hand.
//
//   wstream [-o OFFSET] [-s SIZE] [-n COUNT] [-E ERRNO] DEVICE STREAM
//
// Issues COUNT (default 1) writes of SIZE bytes (default 4096, a multiple of
// 512) at OFFSET, OFFSET+SIZE, ... (default 0) on DEVICE opened O_RDWR|O_DIRECT,
// one at a time, each with write stream STREAM (0..255; 0 = no stream).
// Exit 0 when every write completed in full; with -E ERRNO, exit 0 only when
// every write failed with that errno (e.g. -E 22 for EINVAL). Exit 1 otherwise,
// 2 on usage or set-up errors.
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/io_uring.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#define WRITE_STREAM_OFFSET 44
_Static_assert(offsetof(struct io_uring_sqe, splice_fd_in) == WRITE_STREAM_OFFSET,
               "write_stream must be SQE byte 44");
_Static_assert(sizeof(struct io_uring_sqe) == 64, "64-byte SQE expected");

struct ring {
    int fd;
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_array;
    unsigned *cq_head, *cq_tail, *cq_mask;
    struct io_uring_sqe *sqes;
    struct io_uring_cqe *cqes;
};

static void die(const char *what) {
    fprintf(stderr, "wstream: %s: %s\n", what, strerror(errno));
    exit(2);
}

static unsigned long long parse_num(const char *s, const char *name) {
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 0);
    if (errno || end == s) {
        fprintf(stderr, "wstream: bad %s '%s'\n", name, s);
        exit(2);
    }
    switch (*end) {
    case 'k': case 'K': v <<= 10; end++; break;
    case 'm': case 'M': v <<= 20; end++; break;
    case 'g': case 'G': v <<= 30; end++; break;
    }
    if (*end) {
        fprintf(stderr, "wstream: bad %s '%s'\n", name, s);
        exit(2);
    }
    return v;
}

static void ring_init(struct ring *r) {
    struct io_uring_params p;
    memset(&p, 0, sizeof(p));
    r->fd = (int)syscall(__NR_io_uring_setup, 4, &p);
    if (r->fd < 0)
        die("io_uring_setup");
    size_t sq_len = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    size_t cq_len = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    char *sq = mmap(NULL, sq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd,
                    IORING_OFF_SQ_RING);
    if (sq == MAP_FAILED)
        die("mmap sq ring");
    char *cq = mmap(NULL, cq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd,
                    IORING_OFF_CQ_RING);
    if (cq == MAP_FAILED)
        die("mmap cq ring");
    r->sqes = mmap(NULL, p.sq_entries * sizeof(struct io_uring_sqe), PROT_READ | PROT_WRITE,
                   MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_SQES);
    if (r->sqes == MAP_FAILED)
        die("mmap sqes");
    r->sq_head = (unsigned *)(sq + p.sq_off.head);
    r->sq_tail = (unsigned *)(sq + p.sq_off.tail);
    r->sq_mask = (unsigned *)(sq + p.sq_off.ring_mask);
    r->sq_array = (unsigned *)(sq + p.sq_off.array);
    r->cq_head = (unsigned *)(cq + p.cq_off.head);
    r->cq_tail = (unsigned *)(cq + p.cq_off.tail);
    r->cq_mask = (unsigned *)(cq + p.cq_off.ring_mask);
    r->cqes = (struct io_uring_cqe *)(cq + p.cq_off.cqes);
}

// Submit one write with the given stream and wait for its completion: returns cqe->res.
static int write_one(struct ring *r, int fd, void *buf, unsigned len, unsigned long long off,
                     uint8_t stream) {
    unsigned tail = *r->sq_tail;
    unsigned idx = tail & *r->sq_mask;
    struct io_uring_sqe *sqe = &r->sqes[idx];
    memset(sqe, 0, sizeof(*sqe));
    sqe->opcode = IORING_OP_WRITE;
    sqe->fd = fd;
    sqe->addr = (uintptr_t)buf;
    sqe->len = len;
    sqe->off = off;
    sqe->user_data = 1;
    ((uint8_t *)sqe)[WRITE_STREAM_OFFSET] = stream;
    r->sq_array[idx] = idx;
    __atomic_store_n(r->sq_tail, tail + 1, __ATOMIC_RELEASE);

    for (;;) {
        long ret = syscall(__NR_io_uring_enter, r->fd, 1, 1, IORING_ENTER_GETEVENTS, NULL, 0);
        if (ret >= 0)
            break;
        if (errno != EINTR)
            die("io_uring_enter");
    }
    unsigned head = *r->cq_head;
    while (head == __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE)) {
        if (syscall(__NR_io_uring_enter, r->fd, 0, 1, IORING_ENTER_GETEVENTS, NULL, 0) < 0 &&
            errno != EINTR)
            die("io_uring_enter");
    }
    int res = r->cqes[head & *r->cq_mask].res;
    __atomic_store_n(r->cq_head, head + 1, __ATOMIC_RELEASE);
    return res;
}

static void usage(void) {
    fprintf(stderr,
            "usage: wstream [-o OFFSET] [-s SIZE] [-n COUNT] [-E ERRNO] DEVICE STREAM\n");
    exit(2);
}

int main(int argc, char **argv) {
    unsigned long long off = 0, size = 4096, count = 1;
    int expect_errno = 0, opt;
    while ((opt = getopt(argc, argv, "o:s:n:E:h")) != -1) {
        switch (opt) {
        case 'o': off = parse_num(optarg, "offset"); break;
        case 's': size = parse_num(optarg, "size"); break;
        case 'n': count = parse_num(optarg, "count"); break;
        case 'E': expect_errno = (int)parse_num(optarg, "errno"); break;
        default: usage();
        }
    }
    if (argc - optind != 2)
        usage();
    const char *dev = argv[optind];
    unsigned long long stream = parse_num(argv[optind + 1], "stream");
    if (stream > 255 || size == 0 || size % 512 || size > (1u << 30) || off % 512)
        usage();

    int fd = open(dev, O_RDWR | O_DIRECT);
    if (fd < 0)
        die(dev);
    void *buf;
    if (posix_memalign(&buf, 4096, size))
        die("posix_memalign");
    struct ring r;
    ring_init(&r);

    int failed = 0;
    for (unsigned long long i = 0; i < count; i++) {
        memset(buf, (int)((stream * 16 + i) & 0xff), size);
        unsigned long long at = off + i * size;
        int res = write_one(&r, fd, buf, (unsigned)size, at, (uint8_t)stream);
        if (res < 0) {
            if (expect_errno && -res == expect_errno) {
                printf("wstream: %s stream %llu offset %llu: %s (expected)\n", dev, stream, at,
                       strerror(-res));
                continue;
            }
            fprintf(stderr, "wstream: %s stream %llu offset %llu: %s\n", dev, stream, at,
                    strerror(-res));
            failed = 1;
        } else if (expect_errno) {
            fprintf(stderr, "wstream: %s stream %llu offset %llu: wrote %d bytes, expected %s\n",
                    dev, stream, at, res, strerror(expect_errno));
            failed = 1;
        } else if ((unsigned long long)res != size) {
            fprintf(stderr, "wstream: %s stream %llu offset %llu: short write %d of %llu\n", dev,
                    stream, at, res, size);
            failed = 1;
        } else {
            printf("wstream: %s stream %llu offset %llu: wrote %llu bytes\n", dev, stream, at,
                   size);
        }
    }
    return failed;
}
