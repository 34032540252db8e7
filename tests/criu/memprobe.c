// SPDX-License-Identifier: Apache-2.0
/*
 * memprobe: probes where memory restored with --mmap-restore could
 * behave unlike anonymous memory, for the CRIU tests.
 *
 *   memprobe DIR [CHILDREN]
 *
 * Sets up the regions below, fills them with known patterns, and forks
 * CHILDREN (default 0) children, each of which serves DIR/c<i> the same
 * way and adds an "own" region of its own (the inherited ones stay
 * copy-on-write shared with the parent). Each process writes its
 * regions ("name start end", hex) to <dir>/regions, then <dir>/ready.
 *
 * Commands: write <dir>/cmd, send SIGUSR1; the process runs the command
 * and replaces <dir>/result with "<seq> OK|FAIL <text>". Commands:
 *
 *   verify               check every page of every region
 *   dontneed R           MADV_DONTNEED all of R, then count its pages that
 *                        read as zeroes and as the data that was there
 *   free R               MADV_FREE R: "errno=N"
 *   wipeonfork R         MADV_WIPEONFORK R: "errno=N"
 *   forkread R           fork; the child counts R's zero and data pages
 *   forkcow R            fork; the child writes the even pages of R, the
 *                        parent the odd ones; both check all of R
 *   uffd R               register R with userfaultfd (MISSING): "errno=N"
 *   exec R               mprotect(R, PROT_READ | PROT_EXEC), then back
 *   mremap R MIB         grow R by MIB with mremap(MREMAP_MAYMOVE); on
 *                        success check the old data, that the new part
 *                        reads zeroes, and write it: "errno=N"
 *   realloc R MIB        R is malloc()ed: realloc() it MIB larger, check
 *                        the data, write the new part; then realloc() it
 *                        back to its size, and larger again
 *   growpiece R          mremap the second page of R onwards 1 GiB larger
 *                        (past the end of any pages image), touching
 *                        nothing new: the mapping a re-dump must survive
 *   lastpage R           does the last page of R read as zeroes?
 *   purge R              what jemalloc does to a free extent: MADV_DONTNEED
 *                        then count on zeroes (counts zero/data pages)
 *   refill R             write R with a new generation of its pattern
 *
 * Regions (every page a known pattern):
 *   plain    16 MiB private anonymous
 *   cow      16 MiB private anonymous (for forkcow)
 *   arena     8 MiB private anonymous, MAP_NORESERVE unless
 *             vm.overcommit_memory is 2: as jemalloc maps its arenas
 *   wof       2 MiB, MADV_WIPEONFORK
 *   c0..c2    8 MiB each, malloc()ed first: neighbouring glibc mmapped
 *             chunks at the top of the address space, one VMA
 *   chunk    64 MiB malloc()ed (a glibc mmapped chunk)
 *   guarded   4 MiB with a guard page (MADV_GUARD_INSTALL) at page 100,
 *             if the kernel has them (then DIR/guard says 1)
 *   file      MEMPROBE_MAPFILE mapped MAP_PRIVATE, if set (not checked)
 *   own       4 MiB private anonymous, in children only
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <malloc.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define PAGE 4096UL
#define MIB (1024UL * 1024UL)
#define MAXREG 16
#ifndef MADV_GUARD_INSTALL
#define MADV_GUARD_INSTALL 102
#endif

#define ZERO (~0UL)	 /* a page that reads as zeroes */
#define GUARD (~0UL - 1) /* a guard page: do not touch */

struct region {
	const char *name;
	char *p;
	unsigned long size;
	unsigned int id;
	unsigned long gen;   /* the generation last written */
	unsigned long *pgen; /* what each page holds: a generation, ZERO or GUARD */
	unsigned long base;  /* page number of p in the pattern */
	unsigned long check; /* pages checked by verify, 0: all */
};

static struct region regions[MAXREG];
static int nregions;
static char dir[4096];
static volatile sig_atomic_t want;
static unsigned long seq;

static uint64_t pattern(unsigned int id, unsigned long word, unsigned long gen)
{
	uint64_t x = ((uint64_t)id << 56) ^ (word * 0x9E3779B97F4A7C15ULL) ^ (gen * 0xC2B2AE3D27D4EB4FULL);

	x ^= x >> 31;
	x *= 0xBF58476D1CE4E5B9ULL;
	return x ^ (x >> 29) ^ 1; /* never a zero word */
}

static void fill_page(struct region *r, unsigned long pg, unsigned long gen)
{
	uint64_t *w = (uint64_t *)(r->p + pg * PAGE);
	unsigned long i;

	for (i = 0; i < PAGE / 8; i++)
		w[i] = pattern(r->id, (r->base + pg) * (PAGE / 8) + i, gen);
}

static void set_pages(struct region *r, unsigned long npages)
{
	r->pgen = realloc(r->pgen, npages * sizeof(*r->pgen));
	if (!r->pgen)
		exit(2);
}

static void fill(struct region *r, unsigned long gen)
{
	unsigned long pg;

	set_pages(r, r->size / PAGE);
	for (pg = 0; pg < r->size / PAGE; pg++) {
		if (r->pgen[pg] == GUARD && gen)
			continue;
		fill_page(r, pg, gen);
		r->pgen[pg] = gen;
	}
	r->gen = gen;
}

/* 1: the page holds generation gen; 0: zeroes; -1: anything else */
static int page_is(struct region *r, unsigned long pg, unsigned long gen)
{
	const uint64_t *w = (const uint64_t *)(r->p + pg * PAGE);
	unsigned long i, zero = 0, data = 0;

	for (i = 0; i < PAGE / 8; i++) {
		if (w[i] == 0)
			zero++;
		else if (w[i] == pattern(r->id, (r->base + pg) * (PAGE / 8) + i, gen))
			data++;
	}
	if (data == PAGE / 8)
		return 1;
	if (zero == PAGE / 8)
		return 0;
	return -1;
}

/*
 * Count r's pages that read as zeroes, as what was last written there
 * (data), as an older generation (old) or as anything else (other);
 * remember what each one holds now.
 */
static void census(struct region *r, char *out, size_t len)
{
	unsigned long pg, g, zero = 0, data = 0, old = 0, other = 0;

	for (pg = 0; pg < r->size / PAGE; pg++) {
		if (r->pgen[pg] == GUARD)
			continue;
		if (page_is(r, pg, 0) == 0) {
			zero++;
			r->pgen[pg] = ZERO;
			continue;
		}
		for (g = r->gen + 1; g-- > 0;)
			if (page_is(r, pg, g) == 1)
				break;
		if (g == ~0UL) {
			other++;
		} else {
			if (r->pgen[pg] == g)
				data++;
			else
				old++;
			r->pgen[pg] = g;
		}
	}
	snprintf(out, len, "zero=%lu data=%lu old=%lu other=%lu", zero, data, old, other);
}

static struct region *add_region(const char *name, unsigned long size, int flags)
{
	struct region *r = &regions[nregions];
	char *p;

	r->name = name;
	r->size = size;
	r->id = nregions + 1 + (getpid() & 0xff) * 16;
	if (flags < 0) {
		r->p = malloc(size);
	} else {
		/* Keep regions apart, so that no two VMAs merge */
		p = mmap(NULL, size + 2 * PAGE, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		if (p == MAP_FAILED)
			exit(2);
		munmap(p, size + 2 * PAGE);
		r->p = mmap(p + PAGE, size, PROT_READ | PROT_WRITE, flags | MAP_FIXED_NOREPLACE, -1, 0);
	}
	if (!r->p || r->p == MAP_FAILED) {
		perror(name);
		exit(2);
	}
	nregions++;
	return r;
}

static struct region *find(const char *name)
{
	int i;

	for (i = 0; i < nregions; i++)
		if (!strcmp(regions[i].name, name))
			return &regions[i];
	return NULL;
}

static void put_file(const char *name, const char *text)
{
	char path[4200], tmp[4200];
	int fd;

	snprintf(path, sizeof(path), "%s/%s", dir, name);
	snprintf(tmp, sizeof(tmp), "%s/.%s.tmp", dir, name);
	fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
	if (fd < 0 || write(fd, text, strlen(text)) != (ssize_t)strlen(text) || close(fd) || rename(tmp, path)) {
		perror("put_file");
		exit(2);
	}
}

static void put_regions(void)
{
	char text[4096];
	int i, n = 0;

	for (i = 0; i < nregions; i++)
		n += snprintf(text + n, sizeof(text) - n, "%s %lx %lx\n", regions[i].name,
			      (unsigned long)regions[i].p, (unsigned long)regions[i].p + regions[i].size);
	put_file("regions", text);
}

static int verify(char *out, size_t len)
{
	unsigned long pg;
	int i, n = 0, ok = 1;

	for (i = 0; i < nregions; i++) {
		struct region *r = &regions[i];
		unsigned long npages = r->check ? r->check : r->size / PAGE;

		for (pg = 0; pg < npages; pg++) {
			unsigned long g = r->pgen[pg];

			if (g != GUARD && page_is(r, pg, g == ZERO ? 0 : g) != (g == ZERO ? 0 : 1))
				break;
		}
		if (pg != npages) {
			ok = 0;
			n += snprintf(out + n, len - n, "%s:badpage=%lu ", r->name, pg);
		}
	}
	if (ok)
		snprintf(out, len, "all");
	return ok;
}

/* Fork; the child counts r's pages and reports through a pipe */
static int forkread(struct region *r, char *out, size_t len)
{
	int fds[2], st;
	pid_t pid;
	ssize_t n;

	if (pipe(fds))
		return 0;
	pid = fork();
	if (pid == 0) {
		char buf[128];

		census(r, buf, sizeof(buf));
		if (write(fds[1], buf, strlen(buf)) < 0)
			_exit(1);
		_exit(0);
	}
	close(fds[1]);
	n = read(fds[0], out, len - 1);
	close(fds[0]);
	waitpid(pid, &st, 0);
	out[n > 0 ? n : 0] = '\0';
	return pid > 0 && n > 0 && WIFEXITED(st) && !WEXITSTATUS(st);
}

/*
 * Fork; the child writes generation gen+1 into the even pages and the
 * parent gen+2 into the odd ones; each checks that it sees its own
 * writes and the old data elsewhere.
 */
static int check_cow(struct region *r, int odd, unsigned long mine)
{
	unsigned long pg;

	for (pg = 0; pg < r->size / PAGE; pg++)
		if (page_is(r, pg, (pg & 1) == (unsigned long)odd ? mine : r->gen) != 1)
			return 0;
	return 1;
}

static int forkcow(struct region *r, char *out, size_t len)
{
	unsigned long pg, gen = r->gen;
	int go[2], st, ok;
	pid_t pid;
	char c;

	if (pipe(go))
		return 0;
	pid = fork();
	if (pid == 0) {
		close(go[1]);
		for (pg = 0; pg < r->size / PAGE; pg += 2)
			fill_page(r, pg, gen + 1);
		/* Wait for the parent to write its pages, then check */
		if (read(go[0], &c, 1) != 1)
			_exit(3);
		_exit(check_cow(r, 0, gen + 1) ? 0 : 1);
	}
	close(go[0]);
	for (pg = 1; pg < r->size / PAGE; pg += 2)
		fill_page(r, pg, gen + 2);
	if (write(go[1], "x", 1) != 1)
		return 0;
	close(go[1]);
	waitpid(pid, &st, 0);
	ok = check_cow(r, 1, gen + 2);
	snprintf(out, len, "child=%s parent=%s", WIFEXITED(st) && !WEXITSTATUS(st) ? "ok" : "bad",
		 ok ? "ok" : "bad");
	fill(r, gen + 3);
	return pid > 0 && ok && WIFEXITED(st) && !WEXITSTATUS(st);
}

static int uffd_register(struct region *r)
{
	struct uffdio_api api = { .api = UFFD_API };
	struct uffdio_register reg = {
		.range = { .start = (unsigned long)r->p, .len = r->size },
		.mode = UFFDIO_REGISTER_MODE_MISSING,
	};
	int fd, err = 0;

	fd = syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK);
	if (fd < 0)
		return -errno;
	if (ioctl(fd, UFFDIO_API, &api) || ioctl(fd, UFFDIO_REGISTER, &reg))
		err = errno;
	else
		ioctl(fd, UFFDIO_UNREGISTER, &reg.range);
	close(fd);
	return err;
}

/* Grow r by extra bytes with mremap(); returns errno, 0 on success */
static int grow(struct region *r, unsigned long extra, char *out, size_t len)
{
	unsigned long pg, old = r->size / PAGE;
	char *p;

	p = mremap(r->p, r->size, r->size + extra, MREMAP_MAYMOVE);
	if (p == MAP_FAILED)
		return errno;
	r->p = p;
	r->size += extra;
	set_pages(r, r->size / PAGE);
	for (pg = 0; pg < old; pg++)
		if (page_is(r, pg, r->gen) != 1)
			break;
	snprintf(out, len, "old=%s", pg == old ? "ok" : "bad");
	for (pg = old; pg < r->size / PAGE; pg++)
		if (page_is(r, pg, r->gen) != 0)
			break;
	snprintf(out + strlen(out), len - strlen(out), " new=%s", pg == r->size / PAGE ? "zeroes" : "garbage");
	for (pg = old; pg < r->size / PAGE; pg++) {
		fill_page(r, pg, r->gen);
		r->pgen[pg] = r->gen;
	}
	put_regions();
	return 0;
}

static int do_realloc(struct region *r, unsigned long extra, char *out, size_t len)
{
	unsigned long pg, size = r->size, big = r->size + extra;
	int ok = 1, round;
	char *p;

	for (round = 0; round < 2; round++) {
		p = realloc(r->p, big);
		if (!p)
			return 0;
		r->p = p;
		r->size = big;
		set_pages(r, big / PAGE);
		for (pg = 0; pg < size / PAGE; pg++)
			if (page_is(r, pg, r->pgen[pg]) != 1)
				ok = 0;
		for (pg = size / PAGE; pg < big / PAGE; pg++) {
			fill_page(r, pg, r->gen);
			r->pgen[pg] = r->gen;
		}
		if (round == 0) {
			/* back to the old size, then larger again */
			p = realloc(r->p, size);
			if (!p)
				return 0;
			r->p = p;
			r->size = size;
		}
	}
	put_regions();
	snprintf(out, len, "data=%s", ok ? "ok" : "bad");
	return ok;
}

static int growpiece(struct region *r, char *out, size_t len)
{
	struct region *q = &regions[nregions];
	unsigned long size = r->size - PAGE + 1024 * MIB;
	char *p;

	p = mremap(r->p + PAGE, r->size - PAGE, size, MREMAP_MAYMOVE);
	if (p == MAP_FAILED) {
		snprintf(out, len, "errno=%d", errno);
		return 0;
	}
	/* r keeps its first page; the rest lives at p, grown, untouched past r's end */
	*q = *r;
	q->name = "piece";
	q->p = p;
	q->size = size;
	q->base = r->base + 1;
	q->check = r->size / PAGE - 1;
	q->pgen = NULL;
	set_pages(q, size / PAGE);
	memcpy(q->pgen, r->pgen + 1, q->check * sizeof(*q->pgen));
	r->size = PAGE;
	nregions++;
	put_regions();
	snprintf(out, len, "piece=%lx-%lx", (unsigned long)p, (unsigned long)p + size);
	return 1;
}

static void run(void)
{
	char cmd[256], name[64], out[512] = "", path[4200], res[700];
	unsigned long arg = 0;
	struct region *r = NULL;
	int ok = 0, fd, n;

	snprintf(path, sizeof(path), "%s/cmd", dir);
	fd = open(path, O_RDONLY);
	n = fd < 0 ? -1 : read(fd, cmd, sizeof(cmd) - 1);
	if (fd >= 0)
		close(fd);
	cmd[n > 0 ? n : 0] = '\0';
	name[0] = '\0';
	n = sscanf(cmd, "%63s %*s %lu", name, &arg);
	{
		char rn[64] = "";

		if (sscanf(cmd, "%*s %63s", rn) == 1)
			r = find(rn);
	}

	if (!strcmp(name, "verify")) {
		ok = verify(out, sizeof(out));
	} else if (!r) {
		snprintf(out, sizeof(out), "bad command: %s", cmd);
	} else if (!strcmp(name, "dontneed") || !strcmp(name, "purge")) {
		ok = !madvise(r->p, r->size, MADV_DONTNEED);
		census(r, out, sizeof(out));
	} else if (!strcmp(name, "free")) {
		ok = 1;
		snprintf(out, sizeof(out), "errno=%d", madvise(r->p, r->size, MADV_FREE) ? errno : 0);
		/* Whatever it did, the data is either there or gone: make it known */
		fill(r, r->gen + 1);
	} else if (!strcmp(name, "wipeonfork")) {
		ok = 1;
		snprintf(out, sizeof(out), "errno=%d", madvise(r->p, r->size, MADV_WIPEONFORK) ? errno : 0);
	} else if (!strcmp(name, "forkread")) {
		ok = forkread(r, out, sizeof(out));
	} else if (!strcmp(name, "forkcow")) {
		ok = forkcow(r, out, sizeof(out));
	} else if (!strcmp(name, "uffd")) {
		ok = 1;
		snprintf(out, sizeof(out), "errno=%d", uffd_register(r));
	} else if (!strcmp(name, "exec")) {
		int err = mprotect(r->p, r->size, PROT_READ | PROT_EXEC) ? errno : 0;

		ok = !mprotect(r->p, r->size, PROT_READ | PROT_WRITE);
		snprintf(out, sizeof(out), "errno=%d", err);
	} else if (!strcmp(name, "mremap")) {
		int err = grow(r, arg * MIB, out, sizeof(out));

		ok = 1;
		snprintf(out + strlen(out), sizeof(out) - strlen(out), "%serrno=%d", err ? "" : " ", err);
	} else if (!strcmp(name, "realloc")) {
		ok = do_realloc(r, arg * MIB, out, sizeof(out));
	} else if (!strcmp(name, "growpiece")) {
		ok = growpiece(r, out, sizeof(out));
	} else if (!strcmp(name, "lastpage")) {
		ok = 1;
		snprintf(out, sizeof(out), "last=%s", page_is(r, r->size / PAGE - 1, r->gen) == 0 ? "zeroes" : "data");
	} else if (!strcmp(name, "refill")) {
		fill(r, r->gen + 1);
		ok = 1;
	} else {
		snprintf(out, sizeof(out), "bad command: %s", cmd);
	}

	seq++;
	snprintf(res, sizeof(res), "%lu %s %s\n", seq, ok ? "OK" : "FAIL", out);
	put_file("result", res);
}

static void on_usr1(int sig)
{
	(void)sig;
	want = 1;
}

static int overcommit_never(void)
{
	char buf[16] = "";
	int fd = open("/proc/sys/vm/overcommit_memory", O_RDONLY);

	if (fd >= 0) {
		if (read(fd, buf, sizeof(buf) - 1) < 0)
			buf[0] = '\0';
		close(fd);
	}
	return atoi(buf) == 2;
}

static void serve(void)
{
	struct timespec ts = { 0, 2 * 1000 * 1000 };
	char pid[32];

	signal(SIGUSR1, on_usr1);
	put_regions();
	snprintf(pid, sizeof(pid), "%d\n", getpid());
	put_file("pid", pid);
	put_file("ready", "1\n");
	for (;;) {
		if (want) {
			want = 0;
			run();
		}
		nanosleep(&ts, NULL);
	}
}

int main(int argc, char **argv)
{
	int i, children = argc > 2 ? atoi(argv[2]) : 0;
	struct region *r;

	if (argc < 2) {
		fprintf(stderr, "usage: %s DIR [CHILDREN]\n", argv[0]);
		return 1;
	}
	snprintf(dir, sizeof(dir), "%s", argv[1]);
	/* A 64 MiB chunk is mmapped whatever the dynamic threshold */
	mallopt(M_MMAP_THRESHOLD, 1024 * 1024);

	/*
	 * First, so that they are at the top: neighbouring chunks, merged into
	 * one VMA, below a spacer that keeps them from merging with whatever
	 * is above. 8 MiB - 32 bytes makes a chunk of 8 MiB exactly, every
	 * page of which is written.
	 */
	if (mmap(NULL, PAGE, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0) == MAP_FAILED)
		return 2;
	fill(add_region("c0", 8 * MIB - 32, -1), 0);
	fill(add_region("c1", 8 * MIB - 32, -1), 0);
	fill(add_region("c2", 8 * MIB - 32, -1), 0);

	fill(add_region("plain", 16 * MIB, MAP_PRIVATE | MAP_ANONYMOUS), 0);
	fill(add_region("cow", 16 * MIB, MAP_PRIVATE | MAP_ANONYMOUS), 0);
	fill(add_region("arena", 8 * MIB, MAP_PRIVATE | MAP_ANONYMOUS | (overcommit_never() ? 0 : MAP_NORESERVE)),
	     0);
	r = add_region("wof", 2 * MIB, MAP_PRIVATE | MAP_ANONYMOUS);
	if (madvise(r->p, r->size, MADV_WIPEONFORK))
		return 2;
	fill(r, 0);
	fill(add_region("chunk", 64 * MIB, -1), 0);

	/* A guard page (MADV_GUARD_INSTALL, Linux 6.13) in the middle of a region */
	r = add_region("guarded", 4 * MIB, MAP_PRIVATE | MAP_ANONYMOUS);
	fill(r, 0);
	if (!madvise(r->p + 100 * PAGE, PAGE, MADV_GUARD_INSTALL)) {
		r->pgen[100] = GUARD;
		put_file("guard", "1\n");
	}

	/* A private mapping of a file the test names (say, pages-1.img), not checked */
	if (getenv("MEMPROBE_MAPFILE")) {
		int fd = open(getenv("MEMPROBE_MAPFILE"), O_RDONLY);
		struct stat st;
		unsigned long pg;

		if (fd < 0 || fstat(fd, &st))
			return 2;
		r = &regions[nregions++];
		r->name = "file";
		r->size = st.st_size;
		r->p = mmap(NULL, r->size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
		if (r->p == MAP_FAILED)
			return 2;
		close(fd);
		set_pages(r, r->size / PAGE);
		for (pg = 0; pg < r->size / PAGE; pg++)
			r->pgen[pg] = GUARD;
		r->p[0] ^= 1; /* one page copied on write, the rest from the file */
	}

	for (i = 0; i < children; i++) {
		pid_t pid = fork();

		if (pid < 0)
			return 2;
		if (pid == 0) {
			struct region *w = find("wof");
			unsigned long pg;

			for (pg = 0; pg < w->size / PAGE; pg++)
				w->pgen[pg] = ZERO; /* wiped on fork */
			snprintf(dir + strlen(dir), sizeof(dir) - strlen(dir), "/c%d", i);
			mkdir(dir, 0755);
			fill(add_region("own", 4 * MIB, MAP_PRIVATE | MAP_ANONYMOUS), 0);
			serve();
		}
	}
	serve();
	return 0;
}
