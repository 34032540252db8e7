// SPDX-License-Identifier: Apache-2.0
/*
 * heapprobe: a process whose memory is glibc malloc's heap (the brk
 * area, main arena), for the CRIU tests of --mmap-restore-heap.
 *
 *   heapprobe DIR
 *
 * Allocates a few hundred chunks of odd sizes from the heap (the mmap
 * threshold is raised so that none of them gets a mapping of its own),
 * fills each with a pattern of its index and generation, frees some of
 * them, then writes DIR/pid, DIR/regions and DIR/ready.
 *
 * Commands: write DIR/cmd, send SIGUSR1; the process runs the command
 * and replaces DIR/result with "<seq> OK|FAIL <text>" (the protocol of
 * memprobe.c). Commands:
 *
 *   verify       check every byte of every live chunk: "live=N"
 *   churn        free every third live chunk, malloc_trim(0) (which
 *                drops the pages inside free chunks with MADV_DONTNEED),
 *                count the dropped pages that do not read as zeroes
 *                ("stale", the image's data where the heap is mapped),
 *                then calloc() as many chunks of the same sizes, check
 *                that they read as zeroes, and fill them
 *   grow MIB     calloc() MIB more in 4 chunks, which must come from
 *                new break (brk grows): check zeroes, fill them
 *   shrink       free the chunks "grow" made and malloc_trim(0): the
 *                break must come down again
 *   realloc      realloc() a few chunks to twice their size and back,
 *                checking their data each time
 *   brk          the break now (sbrk(0)): "brk=<hex>"
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <malloc.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define PAGE 4096UL
#define MIB (1024UL * 1024UL)
#define NCHUNKS 4096
#define FIRST 320
/* glibc's struct malloc_chunk: prev_size, size, fd, bk, fd_nextsize, bk_nextsize */
#define CHUNK_HDR (6 * sizeof(size_t))

struct chunk {
	unsigned char *p;
	size_t size;
	unsigned int gen;
	int live;
	int grown; /* made by "grow" */
};

static struct chunk chunks[NCHUNKS];
static int nchunks;
static const char *dir;
static volatile sig_atomic_t want;
static unsigned long seq;

static uint64_t word(int i, unsigned int gen, size_t off)
{
	uint64_t x = ((uint64_t)i << 40) ^ ((uint64_t)gen << 32) ^ (off / 8);

	x ^= x >> 31;
	x *= 0x9e3779b97f4a7c15ULL;
	return x | 1; /* never zero */
}

static void fill(struct chunk *c, int i, unsigned int gen)
{
	size_t off;

	c->gen = gen;
	for (off = 0; off + 8 <= c->size; off += 8) {
		uint64_t w = word(i, gen, off);

		memcpy(c->p + off, &w, 8);
	}
}

/* 0 if chunk i holds its pattern (up to len bytes) */
static int check(struct chunk *c, int i, size_t len)
{
	size_t off;

	for (off = 0; off + 8 <= len; off += 8) {
		uint64_t w;

		memcpy(&w, c->p + off, 8);
		if (w != word(i, c->gen, off))
			return -1;
	}
	return 0;
}

static int is_zero(const unsigned char *p, size_t len)
{
	size_t i;

	for (i = 0; i < len; i++)
		if (p[i])
			return 0;
	return 1;
}

static int add(size_t size, int grown)
{
	struct chunk *c;

	if (nchunks == NCHUNKS)
		return -1;
	c = &chunks[nchunks];
	c->p = malloc(size);
	if (!c->p)
		return -1;
	c->size = size;
	c->live = 1;
	c->grown = grown;
	fill(c, nchunks, 1);
	return nchunks++;
}

static int verify(char *out, size_t len)
{
	int i, live = 0;

	for (i = 0; i < nchunks; i++) {
		if (!chunks[i].live)
			continue;
		if (check(&chunks[i], i, chunks[i].size)) {
			snprintf(out, len, "chunk %d (%p, %zu bytes, gen %u) is corrupt", i, (void *)chunks[i].p,
				 chunks[i].size, chunks[i].gen);
			return 0;
		}
		live++;
	}
	snprintf(out, len, "live=%d", live);
	return 1;
}

/* Pages of c that malloc_trim() may drop: past the chunk header, before the next one */
static size_t stale_pages(struct chunk *c)
{
	unsigned long a = ((unsigned long)c->p + CHUNK_HDR + PAGE - 1) & ~(PAGE - 1);
	unsigned long b = ((unsigned long)c->p + c->size - 2 * sizeof(size_t)) & ~(PAGE - 1);
	size_t n = 0;

	for (; a + PAGE <= b; a += PAGE)
		if (!is_zero((unsigned char *)a, PAGE))
			n++;
	return n;
}

static int churn(char *out, size_t len)
{
	int i, k = 0, freed[NCHUNKS], nfreed = 0, zero = 0;
	size_t stale = 0;

	for (i = 0; i < nchunks; i++) {
		if (!chunks[i].live || chunks[i].grown || k++ % 3)
			continue;
		free(chunks[i].p);
		chunks[i].live = 0;
		freed[nfreed++] = i;
	}
	malloc_trim(0);
	/* Reading freed memory: what MADV_DONTNEED left there */
	for (i = 0; i < nfreed; i++)
		stale += stale_pages(&chunks[freed[i]]);

	for (i = 0; i < nfreed; i++) {
		struct chunk *c = &chunks[freed[i]];

		c->p = calloc(1, c->size);
		if (!c->p) {
			snprintf(out, len, "calloc(%zu) failed", c->size);
			return 0;
		}
		if (is_zero(c->p, c->size))
			zero++;
		c->live = 1;
		fill(c, freed[i], c->gen + 1);
	}
	snprintf(out, len, "freed=%d stale=%zu calloc_zero=%d", nfreed, stale, zero);
	return zero == nfreed;
}

static int grow(unsigned long mib, char *out, size_t len)
{
	void *before = sbrk(0), *after;
	int i, zero = 0;

	for (i = 0; i < 4; i++) {
		struct chunk *c;

		if (nchunks == NCHUNKS)
			return 0;
		c = &chunks[nchunks];
		c->size = mib * MIB / 4;
		c->p = calloc(1, c->size);
		if (!c->p) {
			snprintf(out, len, "calloc(%zu) failed", c->size);
			return 0;
		}
		if (is_zero(c->p, c->size))
			zero++;
		c->live = 1;
		c->grown = 1;
		fill(c, nchunks, 1);
		nchunks++;
	}
	after = sbrk(0);
	snprintf(out, len, "calloc_zero=%d brk_before=%lx brk_after=%lx", zero, (unsigned long)before,
		 (unsigned long)after);
	return zero == 4;
}

static int shrink(char *out, size_t len)
{
	void *before = sbrk(0);
	int i, n = 0;

	for (i = nchunks - 1; i >= 0; i--) {
		if (!chunks[i].grown || !chunks[i].live)
			continue;
		free(chunks[i].p);
		chunks[i].live = 0;
		n++;
	}
	malloc_trim(0);
	snprintf(out, len, "freed=%d brk_before=%lx brk_after=%lx", n, (unsigned long)before,
		 (unsigned long)sbrk(0));
	return 1;
}

static int do_realloc(char *out, size_t len)
{
	int i, k = 0, moved = 0;

	for (i = 0; i < nchunks && k < 8; i++) {
		struct chunk *c = &chunks[i];
		unsigned char *p;
		size_t size = c->size;

		if (!c->live || c->grown)
			continue;
		k++;
		p = realloc(c->p, 2 * size);
		if (!p) {
			snprintf(out, len, "realloc(%zu) failed", 2 * size);
			return 0;
		}
		moved += p != c->p;
		c->p = p;
		if (check(c, i, size)) {
			snprintf(out, len, "chunk %d lost its data in realloc() to %zu", i, 2 * size);
			return 0;
		}
		c->size = 2 * size;
		fill(c, i, c->gen + 1);
		p = realloc(c->p, size);
		if (!p) {
			snprintf(out, len, "realloc(%zu) back failed", size);
			return 0;
		}
		c->p = p;
		c->size = size;
		if (check(c, i, size)) {
			snprintf(out, len, "chunk %d lost its data in realloc() back to %zu", i, size);
			return 0;
		}
	}
	snprintf(out, len, "reallocated=%d moved=%d", k, moved);
	return k == 8;
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

static void run(void)
{
	char cmd[256] = "", name[64] = "", out[512] = "", path[4200], res[700];
	unsigned long arg = 0;
	int ok = 0, fd, n;

	snprintf(path, sizeof(path), "%s/cmd", dir);
	fd = open(path, O_RDONLY);
	n = fd < 0 ? -1 : read(fd, cmd, sizeof(cmd) - 1);
	if (fd >= 0)
		close(fd);
	cmd[n > 0 ? n : 0] = '\0';
	sscanf(cmd, "%63s %lu", name, &arg);

	if (!strcmp(name, "verify"))
		ok = verify(out, sizeof(out));
	else if (!strcmp(name, "churn"))
		ok = churn(out, sizeof(out));
	else if (!strcmp(name, "grow") && arg)
		ok = grow(arg, out, sizeof(out));
	else if (!strcmp(name, "shrink"))
		ok = shrink(out, sizeof(out));
	else if (!strcmp(name, "realloc"))
		ok = do_realloc(out, sizeof(out));
	else if (!strcmp(name, "brk"))
		ok = snprintf(out, sizeof(out), "brk=%lx", (unsigned long)sbrk(0)) > 0;
	else
		snprintf(out, sizeof(out), "bad command: %s", cmd);

	seq++;
	snprintf(res, sizeof(res), "%lu %s %s\n", seq, ok ? "OK" : "FAIL", out);
	put_file("result", res);
}

static void on_usr1(int sig)
{
	(void)sig;
	want = 1;
}

int main(int argc, char **argv)
{
	struct timespec ts = { 0, 2 * 1000 * 1000 };
	char text[128];
	int i;

	if (argc < 2) {
		fprintf(stderr, "usage: heapprobe DIR\n");
		return 2;
	}
	dir = argv[1];
	/* Every chunk from the heap, and no trimming but malloc_trim()'s */
	if (!mallopt(M_MMAP_THRESHOLD, 32 * MIB) || !mallopt(M_TRIM_THRESHOLD, 1024 * MIB) ||
	    !mallopt(M_ARENA_MAX, 1)) {
		fprintf(stderr, "mallopt failed\n");
		return 2;
	}
	for (i = 0; i < FIRST; i++)
		if (add(1000 + ((size_t)i * 7919 * 13) % (300 * 1024), 0) < 0) {
			fprintf(stderr, "malloc failed\n");
			return 2;
		}
	/* A chunk never freed: what churn frees never merges into the top */
	if (!malloc(64)) {
		fprintf(stderr, "malloc failed\n");
		return 2;
	}
	/* Some free chunks in the dumped heap too */
	for (i = 0; i < FIRST; i += 5) {
		free(chunks[i].p);
		chunks[i].live = 0;
	}

	signal(SIGUSR1, on_usr1);
	snprintf(text, sizeof(text), "heap %lx %lx\n", (unsigned long)chunks[0].p, (unsigned long)sbrk(0));
	put_file("regions", text);
	snprintf(text, sizeof(text), "%d\n", getpid());
	put_file("pid", text);
	put_file("ready", "1\n");
	for (;;) {
		if (want) {
			want = 0;
			run();
		}
		nanosleep(&ts, NULL);
	}
}
