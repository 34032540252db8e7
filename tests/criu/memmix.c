// SPDX-License-Identifier: Apache-2.0
/*
 * memmix: a process with a mix of memory for CRIU dump/restore tests.
 *
 *   memmix DIR BIG_MIB
 *
 * Sets up the regions below, fills them with known patterns, writes
 * DIR/regions ("name start end" per line, hex) and DIR/ready, then runs
 * until killed. Commands come as signals; each writes DIR/result
 * ("<seq> OK ..." or "<seq> FAIL ...", replaced atomically):
 *
 *   SIGUSR1  verify every region (and that every thread is alive)
 *   SIGUSR2  write into restored pages (every 64th page of "big" and of
 *            "ro" after making it writable for a moment), then verify
 *
 * Regions:
 *   big         private anonymous, BIG_MIB, every word a known pattern
 *   zeros       private anonymous, 4 MiB written with zeroes
 *   ro          8 MiB of pattern, then mprotect(PROT_READ)
 *   sparse      16 MiB, every 7th page written, every 5th only read
 *   holey       4 MiB of pattern with one page never touched
 *   wipeonfork  2 MiB of pattern, MADV_WIPEONFORK
 *   dontfork    2 MiB of pattern, MADV_DONTFORK
 *   hugepage    4 MiB of pattern, MADV_HUGEPAGE
 *   noreserve   2 MiB of pattern, MAP_NORESERVE
 *   growsdown   1 MiB MAP_GROWSDOWN, top 256 KiB of pattern
 *   shared      8 MiB MAP_SHARED | MAP_ANONYMOUS of pattern
 *   malloc      malloc()ed 1 MiB of pattern
 * and 3 threads, each checking a pattern on its own stack.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define PAGE 4096UL
#define MIB (1024UL * 1024UL)
#define NTHREADS 3

enum kind { FULL, ZERO, SPARSE, HOLEY, TOP };

struct region {
	const char *name;
	unsigned long size;
	int prot;
	int flags;
	int madv;	/* -1: none */
	enum kind kind;
	char *p;
	int mutable; /* SIGUSR2 writes every 64th page */
};

static struct region regions[] = {
	{ "big", 0, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, FULL, NULL, 1 },
	{ "zeros", 4 * MIB, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, ZERO, NULL, 0 },
	{ "ro", 8 * MIB, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, FULL, NULL, 1 },
	{ "sparse", 16 * MIB, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, SPARSE, NULL, 0 },
	{ "holey", 4 * MIB, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, HOLEY, NULL, 0 },
	{ "wipeonfork", 2 * MIB, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, MADV_WIPEONFORK, FULL,
	  NULL, 0 },
	{ "dontfork", 2 * MIB, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, MADV_DONTFORK, FULL, NULL,
	  0 },
	{ "hugepage", 4 * MIB, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, MADV_HUGEPAGE, FULL, NULL,
	  0 },
	{ "noreserve", 2 * MIB, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, FULL,
	  NULL, 0 },
	{ "growsdown", 1 * MIB, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_GROWSDOWN, -1, TOP,
	  NULL, 0 },
	{ "shared", 8 * MIB, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, FULL, NULL, 0 },
	{ "malloc", 1 * MIB, 0, 0, -1, FULL, NULL, 0 },
};
#define NREGIONS (sizeof(regions) / sizeof(regions[0]))

static const char *dir;
static volatile sig_atomic_t want_verify, want_mutate;
static unsigned long generation; /* bumped by each mutation */
static unsigned long seq;
static volatile unsigned long thread_ticks[NTHREADS];
static volatile int thread_bad[NTHREADS];

static inline uint64_t pattern(unsigned int r, unsigned long word, unsigned long gen)
{
	uint64_t x = ((uint64_t)r << 56) ^ (word * 0x9E3779B97F4A7C15ULL) ^ (gen * 0xC2B2AE3D27D4EB4FULL);

	x ^= x >> 31;
	x *= 0xBF58476D1CE4E5B9ULL;
	return x ^ (x >> 29) ^ 1; /* never a zero word */
}

/* Which pages hold data, and of which generation */
static int page_written(struct region *rg, unsigned long pg)
{
	unsigned long npages = rg->size / PAGE;

	switch (rg->kind) {
	case FULL:
		return 1;
	case ZERO:
		return 0;
	case SPARSE:
		return pg % 7 == 0;
	case HOLEY:
		return pg != npages / 2;
	case TOP:
		return pg >= npages - npages / 4;
	}
	return 0;
}

static unsigned long page_gen(struct region *rg, unsigned long pg)
{
	return rg->mutable && pg % 64 == 0 ? generation : 0;
}

static void fill_page(unsigned int r, struct region *rg, unsigned long pg, unsigned long gen)
{
	uint64_t *w = (uint64_t *)(rg->p + pg * PAGE);
	unsigned long i, base = pg * (PAGE / 8);

	for (i = 0; i < PAGE / 8; i++)
		w[i] = pattern(r, base + i, gen);
}

static void fill(unsigned int r)
{
	struct region *rg = &regions[r];
	unsigned long pg, npages = rg->size / PAGE;
	volatile char sink = 0;

	for (pg = 0; pg < npages; pg++) {
		if (page_written(rg, pg))
			fill_page(r, rg, pg, 0);
		else if (rg->kind == ZERO)
			memset(rg->p + pg * PAGE, 0, PAGE);
		else if (rg->kind == SPARSE && pg % 5 == 0)
			sink += rg->p[pg * PAGE]; /* maps the zero page */
	}
	(void)sink;
}

/* Returns the number of the first bad page + 1, or 0 if all are fine */
static unsigned long check(unsigned int r)
{
	struct region *rg = &regions[r];
	unsigned long pg, i, npages = rg->size / PAGE;

	for (pg = 0; pg < npages; pg++) {
		const uint64_t *w = (const uint64_t *)(rg->p + pg * PAGE);
		unsigned long base = pg * (PAGE / 8), gen = page_gen(rg, pg);
		int data = page_written(rg, pg);

		for (i = 0; i < PAGE / 8; i++)
			if (w[i] != (data ? pattern(r, base + i, gen) : 0))
				return pg + 1;
	}
	return 0;
}

static void *thread_fn(void *arg)
{
	long id = (long)arg;
	uint64_t local[512]; /* lives on this thread's stack */
	struct timespec ts = { 0, 5 * 1000 * 1000 };
	unsigned int i;

	for (i = 0; i < 512; i++)
		local[i] = pattern(100 + id, i, 0);
	for (;;) {
		for (i = 0; i < 512; i++)
			if (local[i] != pattern(100 + id, i, 0))
				thread_bad[id] = 1;
		thread_ticks[id]++;
		nanosleep(&ts, NULL);
	}
	return NULL;
}

static void put_file(const char *name, const char *text)
{
	char path[4096], tmp[4096];
	int fd;

	snprintf(path, sizeof(path), "%s/%s", dir, name);
	snprintf(tmp, sizeof(tmp), "%s/.%s.tmp", dir, name);
	fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
	if (fd < 0 || write(fd, text, strlen(text)) != (ssize_t)strlen(text) || close(fd)) {
		perror("put_file");
		exit(2);
	}
	if (rename(tmp, path)) {
		perror("rename");
		exit(2);
	}
}

static void verify(void)
{
	char out[4096];
	unsigned long ticks[NTHREADS], bad;
	struct timespec ts = { 0, 50 * 1000 * 1000 };
	int n = 0, ok = 1;
	unsigned int r, t;

	for (t = 0; t < NTHREADS; t++)
		ticks[t] = thread_ticks[t];

	seq++;
	n += snprintf(out + n, sizeof(out) - n, "%lu", seq);
	for (r = 0; r < NREGIONS; r++) {
		bad = check(r);
		if (bad) {
			ok = 0;
			n += snprintf(out + n, sizeof(out) - n, " %s:badpage=%lu", regions[r].name, bad - 1);
		}
	}

	nanosleep(&ts, NULL);
	for (t = 0; t < NTHREADS; t++) {
		if (thread_ticks[t] == ticks[t]) {
			ok = 0;
			n += snprintf(out + n, sizeof(out) - n, " thread%u:stuck", t);
		}
		if (thread_bad[t]) {
			ok = 0;
			n += snprintf(out + n, sizeof(out) - n, " thread%u:stack-corrupt", t);
		}
	}
	snprintf(out + n, sizeof(out) - n, " %s gen=%lu\n", ok ? "OK" : "FAIL", generation);
	put_file("result", out);
}

static void mutate(void)
{
	unsigned int r;
	unsigned long pg;

	generation++;
	for (r = 0; r < NREGIONS; r++) {
		struct region *rg = &regions[r];

		if (!rg->mutable)
			continue;
		if (!(rg->prot & PROT_WRITE) && mprotect(rg->p, rg->size, rg->prot | PROT_WRITE))
			exit(3);
		for (pg = 0; pg < rg->size / PAGE; pg += 64)
			fill_page(r, rg, pg, generation);
		if (!(rg->prot & PROT_WRITE) && mprotect(rg->p, rg->size, rg->prot))
			exit(3);
	}
}

static void on_signal(int sig)
{
	if (sig == SIGUSR2)
		want_mutate = 1;
	else
		want_verify = 1;
}

int main(int argc, char **argv)
{
	struct timespec ts = { 0, 2 * 1000 * 1000 };
	char text[8192];
	pthread_t th[NTHREADS];
	unsigned int r;
	int n = 0;

	if (argc != 3) {
		fprintf(stderr, "usage: %s DIR BIG_MIB\n", argv[0]);
		return 1;
	}
	dir = argv[1];
	regions[0].size = strtoul(argv[2], NULL, 10) * MIB;

	for (r = 0; r < NREGIONS; r++) {
		struct region *rg = &regions[r];
		int prot = rg->prot | PROT_WRITE;

		if (!strcmp(rg->name, "malloc")) {
			rg->p = malloc(rg->size);
			if (!rg->p)
				return 2;
		} else {
			/* Keep the regions apart, so that no two VMAs merge */
			char *p = mmap(NULL, rg->size + 2 * PAGE, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);

			if (p == MAP_FAILED)
				return 2;
			munmap(p, rg->size + 2 * PAGE);
			rg->p = mmap(p + PAGE, rg->size, prot, rg->flags | MAP_FIXED_NOREPLACE, -1, 0);
			if (rg->p == MAP_FAILED) {
				fprintf(stderr, "mmap %s: %s\n", rg->name, strerror(errno));
				return 2;
			}
		}
		if (rg->madv >= 0 && madvise(rg->p, rg->size, rg->madv)) {
			fprintf(stderr, "madvise %s: %s\n", rg->name, strerror(errno));
			return 2;
		}
		fill(r);
		if (rg->prot && rg->prot != prot && mprotect(rg->p, rg->size, rg->prot))
			return 2;
		n += snprintf(text + n, sizeof(text) - n, "%s %lx %lx\n", rg->name, (unsigned long)rg->p,
			      (unsigned long)rg->p + rg->size);
	}

	for (r = 0; r < NTHREADS; r++)
		if (pthread_create(&th[r], NULL, thread_fn, (void *)(long)r))
			return 2;

	signal(SIGUSR1, on_signal);
	signal(SIGUSR2, on_signal);
	put_file("regions", text);
	verify();
	put_file("ready", "1\n");

	for (;;) {
		if (want_mutate) {
			want_mutate = 0;
			mutate();
			verify();
		}
		if (want_verify) {
			want_verify = 0;
			verify();
		}
		nanosleep(&ts, NULL);
	}
}
