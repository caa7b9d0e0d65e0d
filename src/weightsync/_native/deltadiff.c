/* Delta sync's diff in one pass: compare a new version's wire bits with the baseline, emit the
 * changed elements (int32 index + value), and update the baseline only where they changed.
 *
 * Why: numpy needs four passes for this (compare into a mask, find its nonzeros, copy the
 * baseline, gather the values) plus, for a cast push, a fifth that writes the cast into a scratch
 * buffer; each pass streams the tensor through memory. Here the comparison runs 32 bytes at a
 * time (AVX2 where the CPU has it), only blocks holding a change touch the baseline and the
 * output, and an fp32 source is rounded to bf16 in registers, never stored. The range is split
 * over `threads` POSIX threads; the GIL is released throughout.
 *
 *   diff(new, base, itemsize, indices, values, threads[, crcs]) -> count
 *       new, base: same length, elements of `itemsize` bytes (2 or 4) compared by their bits
 *       (NaN payloads and -0.0 are changes when their bits change).
 *   cast_diff(src, base, indices, values, threads[, crcs]) -> count
 *       src: float32, base: bfloat16 of as many elements; src is rounded to bf16 as torch rounds
 *       it (nearest even; every NaN becomes 0xFFFF) and compared with base.
 *
 * Their indices (int32) and values (itemsize bytes each) are writable buffers with room for every
 * element; the first `count` of each are the changes, in ascending index order. With `crcs` (a
 * writable uint64 buffer of 2 * MAX_THREADS), each thread also hashes the new version of its range
 * while it is in cache: pair t is its CRC32C and the bytes of the tensor after its range
 * (checksum.share combines them into the tensor's CRC32C; unused pairs are zero), so the
 * content digest costs no pass of its own. Tensors of
 * 2**31 elements or more are refused (the numpy path handles them).
 *
 *   apply(dest, itemsize, indices, values, threads)
 *       the receiver's side: dest[indices[k]] = values[k], every index checked before any write.
 *
 * The "blocks" encoding: the elements are taken in blocks of 256; a patch gives each block's
 * number of changes (uint16) and each change's offset in its block (one byte).
 *
 *   block_offsets(indices, counts, offsets)
 *       the sender's side: ascending int32 indices -> each block's count (counts, zeroed here)
 *       and each index's low byte (offsets, as many as indices).
 *   apply_blocks(dest, itemsize, counts, offsets, values, threads[, crcs])
 *       the receiver's side: the k-th change lands at 256 * its block + offsets[k]; the counts,
 *       their sum and the last block's offsets are checked before any write. With `crcs`, every
 *       block is hashed where it sits right after its writes, as the diff does.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define HAVE_AVX2_BUILD 1
#else
#define HAVE_AVX2_BUILD 0
#endif

#define MAX_THREADS 16
/* A thread gets at least this many elements: below it, starting threads costs more than it saves. */
#define MIN_PER_THREAD (1 << 18)

enum kind { SAME16, SAME32, CAST_F32_BF16 };

typedef struct {
    enum kind kind;
    const void *src;
    void *base;
    int32_t *indices;
    void *values;
    int64_t start, stop; /* element range [start, stop) */
    int64_t count;       /* changes found, written at indices[start], values[start] */
    uint32_t *crc;       /* NULL, or the running CRC32C of the new version of the range */
} job;

static int use_avx2 = 0;
static uint32_t crc_table[256];

static void crc_table_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        crc_table[i] = c;
    }
}

/* A chunk of this many elements is diffed, then hashed while it is in cache. */
#define HASH_CHUNK 4096

#if HAVE_AVX2_BUILD
/* crc32 has a latency of 3 cycles and a throughput of 1: three streams of STREAM bytes run at
 * once, then join, each register shifted past the bytes after it (`shift`'s tables). */
#define STREAM 2728
static uint32_t shift_table[4][256];

static uint32_t shift(uint32_t c)
{
    return shift_table[0][c & 0xff] ^ shift_table[1][(c >> 8) & 0xff] ^ shift_table[2][(c >> 16) & 0xff] ^
           shift_table[3][c >> 24];
}

__attribute__((target("sse4.2"))) static uint32_t crc_hw(uint32_t crc, const uint8_t *p, size_t n)
{
    uint64_t c = crc;
    for (; n >= 3 * STREAM; n -= 3 * STREAM, p += 3 * STREAM) {
        uint64_t b = 0, d = 0, w0, w1, w2;
        for (size_t k = 0; k < STREAM; k += 8) {
            memcpy(&w0, p + k, 8);
            memcpy(&w1, p + STREAM + k, 8);
            memcpy(&w2, p + 2 * STREAM + k, 8);
            c = _mm_crc32_u64(c, w0);
            b = _mm_crc32_u64(b, w1);
            d = _mm_crc32_u64(d, w2);
        }
        c = shift(shift((uint32_t)c) ^ (uint32_t)b) ^ (uint32_t)d;
    }
    for (; n >= 8; n -= 8, p += 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c = _mm_crc32_u64(c, w);
    }
    uint32_t c32 = (uint32_t)c;
    for (; n; n--)
        c32 = _mm_crc32_u8(c32, *p++);
    return c32;
}
#endif

#if HAVE_AVX2_BUILD
/* shift_table[k][v]: the register v << 8k carried past STREAM zero bytes (a linear map). */
static void shift_table_init(void)
{
    for (int k = 0; k < 4; k++)
        for (uint32_t v = 0; v < 256; v++) {
            uint32_t c = v << (8 * k);
            for (int z = 0; z < STREAM; z++)
                c = crc_table[c & 0xff] ^ (c >> 8);
            shift_table[k][v] = c;
        }
}
#endif

/* CRC32C's register over n more bytes (no pre- or post-inversion: the caller's). */
static inline void crc_update(uint32_t *crc, const void *p, size_t n)
{
    if (crc == NULL)
        return;
#if HAVE_AVX2_BUILD
    if (use_avx2) { /* every AVX2 CPU has SSE4.2's crc32 */
        *crc = crc_hw(*crc, p, n);
        return;
    }
#endif
    const uint8_t *b = p;
    uint32_t c = *crc;
    while (n--)
        c = crc_table[(c ^ *b++) & 0xff] ^ (c >> 8);
    *crc = c;
}

static inline uint16_t round_bf16(uint32_t u)
{
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return 0xffff; /* NaN: what torch's conversion gives */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* Portable element loops: every element, one at a time (also the tails of the AVX2 loops).
 * ROUND turns a source element into the wire element (the identity, or fp32 -> bf16). */
#define SCALAR_LOOP(name, src_t, wire_t, ROUND)                                                           \
    static int64_t name(const src_t *src, wire_t *base, int32_t *idx, wire_t *val, int64_t i, int64_t stop, \
                        int64_t n)                                                                        \
    {                                                                                                     \
        for (; i < stop; i++) {                                                                           \
            wire_t b = ROUND(src[i]);                                                                     \
            if (b != base[i]) {                                                                           \
                base[i] = b;                                                                              \
                idx[n] = (int32_t)i;                                                                      \
                val[n++] = b;                                                                             \
            }                                                                                             \
        }                                                                                                 \
        return n;                                                                                         \
    }
#define SAME(x) (x)
SCALAR_LOOP(same16_scalar, uint16_t, uint16_t, SAME)
SCALAR_LOOP(same32_scalar, uint32_t, uint32_t, SAME)
SCALAR_LOOP(cast_scalar, uint32_t, uint16_t, round_bf16)

#if HAVE_AVX2_BUILD
/* The AVX2 loops take 64 elements at a time: one 64-bit mask of the changed ones, then a loop over
 * its set bits. Blocks of 64 keep the branch mispredictions (the loop's exit) to one per 64
 * elements; at a few percent changed most blocks of 16 hold a change, so per-16 branches cost
 * more than the memory traffic. Only changed elements are written to the baseline. */
#define BLOCK 64

/* Emit the changes flagged in `mask` of the block at `i`, whose new bits are `lanes`. */
static inline int64_t emit16(uint64_t mask, const uint16_t *lanes, uint16_t *base, int32_t *idx, uint16_t *val,
                             int64_t i, int64_t n)
{
    while (mask) {
        int j = __builtin_ctzll(mask);
        base[i + j] = lanes[j];
        idx[n] = (int32_t)(i + j);
        val[n++] = lanes[j];
        mask &= mask - 1;
    }
    return n;
}

/* One bit per element of four vectors of 16-bit compare results (all ones where equal). */
__attribute__((target("avx2"))) static inline uint64_t equal_bits16(__m256i e0, __m256i e1, __m256i e2, __m256i e3)
{
    /* packs interleaves 128-bit lanes (e0.lo e1.lo e0.hi e1.hi); the permute restores the order */
    __m256i p01 = _mm256_permute4x64_epi64(_mm256_packs_epi16(e0, e1), 0xd8);
    __m256i p23 = _mm256_permute4x64_epi64(_mm256_packs_epi16(e2, e3), 0xd8);
    return (uint64_t)(uint32_t)_mm256_movemask_epi8(p01) | (uint64_t)(uint32_t)_mm256_movemask_epi8(p23) << 32;
}

__attribute__((target("avx2"))) static int64_t same16_avx2(const uint16_t *new, uint16_t *base, int32_t *idx,
                                                             uint16_t *val, int64_t i, int64_t stop)
{
    int64_t n = 0;
    for (; i + BLOCK <= stop; i += BLOCK) {
        __m256i e[4];
        for (int k = 0; k < 4; k++)
            e[k] = _mm256_cmpeq_epi16(_mm256_loadu_si256((const __m256i *)(new + i + 16 * k)),
                                      _mm256_loadu_si256((const __m256i *)(base + i + 16 * k)));
        n = emit16(~equal_bits16(e[0], e[1], e[2], e[3]), new + i, base, idx, val, i, n);
    }
    return same16_scalar(new, base, idx, val, i, stop, n);
}

__attribute__((target("avx2"))) static int64_t same32_avx2(const uint32_t *new, uint32_t *base, int32_t *idx,
                                                             uint32_t *val, int64_t i, int64_t stop)
{
    int64_t n = 0;
    for (; i + BLOCK <= stop; i += BLOCK) {
        uint64_t equal = 0;
        for (int k = 0; k < 8; k++) {
            __m256i eq = _mm256_cmpeq_epi32(_mm256_loadu_si256((const __m256i *)(new + i + 8 * k)),
                                            _mm256_loadu_si256((const __m256i *)(base + i + 8 * k)));
            equal |= (uint64_t)(uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(eq)) << (8 * k);
        }
        for (uint64_t mask = ~equal; mask; mask &= mask - 1) {
            int j = __builtin_ctzll(mask);
            base[i + j] = new[i + j];
            idx[n] = (int32_t)(i + j);
            val[n++] = new[i + j];
        }
    }
    return same32_scalar(new, base, idx, val, i, stop, n);
}

/* Eight float32 bit patterns rounded to bf16 (in the low half of each 32-bit lane). */
__attribute__((target("avx2"))) static inline __m256i round8(__m256i u)
{
    const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7fff);
    const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
    __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(u, bias), _mm256_and_si256(_mm256_srli_epi32(u, 16), one)), 16);
    __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, abs_mask), inf); /* signed compare: both < 2**31 */
    return _mm256_or_si256(rounded, _mm256_and_si256(nan, _mm256_set1_epi32(0xffff)));
}

__attribute__((target("avx2"))) static int64_t cast_avx2(const uint32_t *src, uint16_t *base, int32_t *idx,
                                                           uint16_t *val, int64_t i, int64_t stop)
{
    int64_t n = 0;
    uint16_t lanes[BLOCK] __attribute__((aligned(32)));
    for (; i + BLOCK <= stop; i += BLOCK) {
        __m256i e[4];
        for (int k = 0; k < 4; k++) {
            __m256i lo = round8(_mm256_loadu_si256((const __m256i *)(src + i + 16 * k)));
            __m256i hi = round8(_mm256_loadu_si256((const __m256i *)(src + i + 16 * k + 8)));
            __m256i fresh = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xd8);
            _mm256_store_si256((__m256i *)(lanes + 16 * k), fresh);
            e[k] = _mm256_cmpeq_epi16(fresh, _mm256_loadu_si256((const __m256i *)(base + i + 16 * k)));
        }
        n = emit16(~equal_bits16(e[0], e[1], e[2], e[3]), lanes, base, idx, val, i, n);
    }
    return cast_scalar(src, base, idx, val, i, stop, n);
}
#endif

/* The changes in [i, stop) of a job's range, written after the n it found before them. */
static int64_t run_range(const job *j, int64_t i, int64_t stop, int64_t n)
{
    int32_t *idx = j->indices + j->start + n;
    uint16_t *val16 = (uint16_t *)j->values + j->start + n;
    uint32_t *val32 = (uint32_t *)j->values + j->start + n;
#if HAVE_AVX2_BUILD
    if (use_avx2) {
        switch (j->kind) {
        case SAME16:
            return same16_avx2(j->src, j->base, idx, val16, i, stop);
        case SAME32:
            return same32_avx2(j->src, j->base, idx, val32, i, stop);
        case CAST_F32_BF16:
            return cast_avx2(j->src, j->base, idx, val16, i, stop);
        }
    }
#endif
    switch (j->kind) {
    case SAME16:
        return same16_scalar(j->src, j->base, idx, val16, i, stop, 0);
    case SAME32:
        return same32_scalar(j->src, j->base, idx, val32, i, stop, 0);
    default:
        return cast_scalar(j->src, j->base, idx, val16, i, stop, 0);
    }
}

/* One job: its range, its changes written from its own start in the outputs (each job's range
 * has room for all of its elements there); hashing, a chunk at a time, while it is in cache. */
static void *run_job(void *arg)
{
    job *j = (job *)arg;
    size_t wire = j->kind == SAME32 ? 4 : 2;
    int64_t chunk = j->crc ? HASH_CHUNK : j->stop - j->start + 1;
    j->count = 0;
    for (int64_t i = j->start; i < j->stop; i += chunk) {
        int64_t stop = i + chunk < j->stop ? i + chunk : j->stop;
        j->count += run_range(j, i, stop, j->count);
        crc_update(j->crc, (char *)j->base + i * wire, wire * (size_t)(stop - i));
    }
    return NULL;
}

/* Run fn on each of the n jobs (job_size bytes apart), jobs 1..n-1 on threads of their own and
 * job 0 here; a job whose thread could not start also runs here. Returns once all are done. */
static void run_jobs(void *(*fn)(void *), char *jobs, size_t job_size, int n)
{
    pthread_t tids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int t = 1; t < n; t++)
        started[t] = pthread_create(&tids[t], NULL, fn, jobs + t * job_size) == 0;
    fn(jobs);
    for (int t = 1; t < n; t++) {
        if (started[t])
            pthread_join(tids[t], NULL);
        else
            fn(jobs + t * job_size);
    }
}

/* The (CRC32C, bytes after) pairs of n jobs, whose element ranges end at stops[t], into crcs
 * (NULL: none asked), the rest zeroed. */
static void put_crcs(uint64_t *crcs, const uint32_t *running, const int64_t *stops, int n, int64_t numel,
                     size_t itemsize)
{
    if (crcs == NULL)
        return;
    memset(crcs, 0, 2 * MAX_THREADS * sizeof(uint64_t));
    for (int t = 0; t < n; t++) {
        crcs[2 * t] = ~running[t];
        crcs[2 * t + 1] = (uint64_t)(numel - stops[t]) * itemsize;
    }
}

/* Split [0, numel) over up to `threads` jobs, run them, and pack their outputs into one
 * ascending run. A job whose thread could not start runs on the calling thread. Returns the count. */
static int64_t run_split(enum kind kind, const void *src, void *base, int32_t *indices, void *values,
                         size_t itemsize, int64_t numel, int threads, uint64_t *crcs)
{
    job jobs[MAX_THREADS];
    uint32_t running[MAX_THREADS];
    int64_t stops[MAX_THREADS];
    int64_t most = numel / MIN_PER_THREAD;
    int count = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
    if (count > most)
        count = most < 1 ? 1 : (int)most;
    int64_t step = (numel / count + 63) & ~(int64_t)63; /* 64-element aligned ranges */
    for (int t = 0; t < count; t++) {
        int64_t start = t * step < numel ? t * step : numel;
        int64_t stop = (t + 1) * step < numel && t + 1 < count ? (t + 1) * step : numel;
        running[t] = 0xffffffffu;
        stops[t] = stop;
        jobs[t] = (job){kind, src, base, indices, values, start, stop, 0, crcs ? &running[t] : NULL};
    }
    run_jobs(run_job, (char *)jobs, sizeof(job), count);
    put_crcs(crcs, running, stops, count, numel, itemsize);
    int64_t total = jobs[0].count;
    for (int t = 1; t < count; t++) {
        if (jobs[t].count && jobs[t].start != total) {
            memmove(indices + total, indices + jobs[t].start, (size_t)jobs[t].count * sizeof(int32_t));
            memmove((char *)values + total * itemsize, (char *)values + jobs[t].start * itemsize,
                    (size_t)jobs[t].count * itemsize);
        }
        total += jobs[t].count;
    }
    return total;
}

/* Checks shared by both entry points; returns 0 or sets a Python error and returns -1. */
static int check_outputs(Py_buffer *indices, Py_buffer *values, int64_t numel, size_t itemsize)
{
    if (numel >= ((int64_t)1 << 31)) {
        PyErr_SetString(PyExc_ValueError, "deltadiff: 2**31 elements or more (int32 indices)");
        return -1;
    }
    if (indices->len < numel * (Py_ssize_t)sizeof(int32_t) || values->len < numel * (Py_ssize_t)itemsize) {
        PyErr_Format(PyExc_ValueError, "deltadiff: outputs need room for %lld elements", (long long)numel);
        return -1;
    }
    return 0;
}

static int contiguous(Py_buffer *views[], int n)
{
    for (int k = 0; k < n; k++)
        if (!PyBuffer_IsContiguous(views[k], 'C')) {
            PyErr_SetString(PyExc_ValueError, "deltadiff: every buffer must be C-contiguous");
            return 0;
        }
    return 1;
}

/* The optional crcs buffer's memory (NULL where none was given); sets a Python error and returns
 * 0 where it is too small for MAX_THREADS pairs. */
static int crcs_of(Py_buffer *crcs, uint64_t **out)
{
    *out = NULL;
    if (crcs->obj == NULL)
        return 1;
    if (crcs->len < (Py_ssize_t)(2 * MAX_THREADS * sizeof(uint64_t)) || ((uintptr_t)crcs->buf & 7)) {
        PyErr_Format(PyExc_ValueError, "deltadiff: crcs needs room for %d aligned uint64 pairs", MAX_THREADS);
        return 0;
    }
    *out = crcs->buf;
    return 1;
}

/* Check the outputs, run the diff without the GIL, release the buffers (views[4]: crcs, maybe
 * empty). `numel` < 0: the caller found the inputs' sizes wrong and set the error. */
static PyObject *run_checked(enum kind kind, Py_buffer *views[5], int64_t numel, size_t itemsize, int threads)
{
    int64_t count = -1;
    uint64_t *crcs;
    if (numel >= 0 && contiguous(views, 4) && check_outputs(views[2], views[3], numel, itemsize) == 0 &&
        crcs_of(views[4], &crcs)) {
        Py_BEGIN_ALLOW_THREADS
        count = run_split(kind, views[0]->buf, views[1]->buf, views[2]->buf, views[3]->buf, itemsize, numel, threads,
                          crcs);
        Py_END_ALLOW_THREADS
    }
    for (int k = 0; k < 5; k++)
        if (views[k]->obj != NULL)
            PyBuffer_Release(views[k]);
    return count < 0 ? NULL : PyLong_FromLongLong(count);
}

static PyObject *deltadiff_diff(PyObject *self, PyObject *args)
{
    Py_buffer new, base, indices, values, crcs = {0};
    Py_ssize_t itemsize;
    int threads;
    if (!PyArg_ParseTuple(args, "y*w*nw*w*i|w*:diff", &new, &base, &itemsize, &indices, &values, &threads, &crcs))
        return NULL;
    Py_buffer *views[] = {&new, &base, &indices, &values, &crcs};
    int64_t numel = -1;
    if ((itemsize != 2 && itemsize != 4) || new.len != base.len || new.len % itemsize)
        PyErr_Format(PyExc_ValueError, "diff: itemsize %zd (2 or 4), new %zd bytes, base %zd", itemsize, new.len,
                     base.len);
    else
        numel = new.len / itemsize;
    return run_checked(itemsize == 2 ? SAME16 : SAME32, views, numel, (size_t)itemsize, threads);
}

static PyObject *deltadiff_cast_diff(PyObject *self, PyObject *args)
{
    Py_buffer src, base, indices, values, crcs = {0};
    int threads;
    if (!PyArg_ParseTuple(args, "y*w*w*w*i|w*:cast_diff", &src, &base, &indices, &values, &threads, &crcs))
        return NULL;
    Py_buffer *views[] = {&src, &base, &indices, &values, &crcs};
    int64_t numel = -1;
    if (src.len != 2 * base.len || base.len % 2)
        PyErr_Format(PyExc_ValueError, "cast_diff: float32 source of %zd bytes for a bf16 base of %zd", src.len,
                     base.len);
    else
        numel = base.len / 2;
    return run_checked(CAST_F32_BF16, views, numel, 2, threads);
}

/* The receiver's side: dest[indices[k]] = values[k]. Every index is checked before anything is
 * written, so a patch naming an element outside the tensor changes nothing. */
static int64_t first_outside(const int32_t *indices, int64_t count, int64_t numel)
{
    for (int64_t k = 0; k < count; k++)
        if (indices[k] < 0 || indices[k] >= numel)
            return k;
    return -1;
}

typedef struct {
    char *dest;
    const int32_t *indices;
    const char *values;
    int64_t count;
    size_t itemsize;
} scatter_job;

static void *scatter(void *arg)
{
    scatter_job *j = (scatter_job *)arg;
    if (j->itemsize == 2) {
        uint16_t *d = (uint16_t *)j->dest;
        for (int64_t k = 0; k < j->count; k++)
            memcpy(&d[j->indices[k]], j->values + 2 * k, 2);
    } else {
        uint32_t *d = (uint32_t *)j->dest;
        for (int64_t k = 0; k < j->count; k++)
            memcpy(&d[j->indices[k]], j->values + 4 * k, 4);
    }
    return NULL;
}

/* The writes split over up to `threads` threads, each a contiguous run of the changes: at a few
 * percent changed nearly every cache line of the destination is written, a pass at memory speed. */
static void scatter_split(char *dest, const int32_t *indices, const char *values, int64_t count, size_t itemsize,
                          int threads)
{
    scatter_job jobs[MAX_THREADS];
    int64_t most = count / (MIN_PER_THREAD / 16);
    int n = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
    if (n > most)
        n = most < 1 ? 1 : (int)most;
    int64_t step = (count + n - 1) / n;
    for (int t = 0; t < n; t++) {
        int64_t start = t * step < count ? t * step : count;
        int64_t stop = start + step < count ? start + step : count;
        jobs[t] = (scatter_job){dest, indices + start, values + start * itemsize, stop - start, itemsize};
    }
    run_jobs(scatter, (char *)jobs, sizeof(scatter_job), n);
}

static PyObject *deltadiff_apply(PyObject *self, PyObject *args)
{
    Py_buffer dest, indices, values;
    Py_ssize_t itemsize;
    int threads;
    if (!PyArg_ParseTuple(args, "w*ny*y*i:apply", &dest, &itemsize, &indices, &values, &threads))
        return NULL;
    Py_buffer *views[] = {&dest, &indices, &values};
    PyObject *result = NULL;
    int64_t count = indices.len / (Py_ssize_t)sizeof(int32_t), outside = -1;
    if (!contiguous(views, 3))
        ;
    else if ((itemsize != 2 && itemsize != 4) || dest.len % itemsize || indices.len % sizeof(int32_t) ||
             values.len != count * itemsize || ((uintptr_t)indices.buf & 3) || ((uintptr_t)dest.buf % itemsize))
        PyErr_Format(PyExc_ValueError, "apply: itemsize %zd, dest %zd bytes, %zd index bytes, %zd value bytes "
                     "(aligned int32 indices, one value each)", itemsize, dest.len, indices.len, values.len);
    else {
        Py_BEGIN_ALLOW_THREADS
        outside = first_outside(indices.buf, count, dest.len / itemsize);
        if (outside < 0)
            scatter_split(dest.buf, indices.buf, values.buf, count, (size_t)itemsize, threads);
        Py_END_ALLOW_THREADS
        if (outside >= 0)
            PyErr_Format(PyExc_IndexError, "apply: index %d outside %zd elements", ((int32_t *)indices.buf)[outside],
                         dest.len / itemsize);
        else
            result = Py_NewRef(Py_None);
    }
    for (int k = 0; k < 3; k++)
        PyBuffer_Release(views[k]);
    return result;
}

#define PATCH_BLOCK 256

static PyObject *deltadiff_block_offsets(PyObject *self, PyObject *args)
{
    Py_buffer indices, counts, offsets;
    if (!PyArg_ParseTuple(args, "y*w*w*:block_offsets", &indices, &counts, &offsets))
        return NULL;
    Py_buffer *views[] = {&indices, &counts, &offsets};
    PyObject *result = NULL;
    int64_t count = indices.len / (Py_ssize_t)sizeof(int32_t), blocks = counts.len / (Py_ssize_t)sizeof(uint16_t);
    if (!contiguous(views, 3))
        ;
    else if (indices.len % sizeof(int32_t) || offsets.len != count || ((uintptr_t)indices.buf & 3) ||
             ((uintptr_t)counts.buf & 1))
        PyErr_SetString(PyExc_ValueError, "block_offsets: aligned int32 indices, uint16 counts, one offset each");
    else {
        const int32_t *idx = indices.buf;
        uint16_t *per_block = counts.buf;
        uint8_t *low = offsets.buf;
        int64_t outside = -1;
        Py_BEGIN_ALLOW_THREADS
        memset(per_block, 0, (size_t)blocks * sizeof(uint16_t));
        for (int64_t k = 0; k < count; k++) {
            int64_t block = idx[k] / PATCH_BLOCK;
            if (idx[k] < 0 || block >= blocks) {
                outside = k;
                break;
            }
            per_block[block]++;
            low[k] = (uint8_t)(idx[k] % PATCH_BLOCK);
        }
        Py_END_ALLOW_THREADS
        if (outside >= 0)
            PyErr_Format(PyExc_IndexError, "block_offsets: index %d outside %lld blocks", idx[outside],
                         (long long)blocks);
        else
            result = Py_NewRef(Py_None);
    }
    for (int k = 0; k < 3; k++)
        PyBuffer_Release(views[k]);
    return result;
}

typedef struct {
    char *dest;
    const uint16_t *counts; /* this job's blocks' counts */
    const uint8_t *offsets; /* and their changes, from this job's first */
    const char *values;
    int64_t first_block, blocks, numel;
    size_t itemsize;
    uint32_t *crc; /* NULL, or the running CRC32C of the job's blocks as written */
} block_job;

static void *scatter_blocks(void *arg)
{
    block_job *j = (block_job *)arg;
    const uint8_t *off = j->offsets;
    const char *val = j->values;
    for (int64_t b = 0; b < j->blocks; b++) {
        uint16_t n;
        memcpy(&n, &j->counts[b], sizeof n);
        char *base = j->dest + (size_t)(j->first_block + b) * PATCH_BLOCK * j->itemsize;
        if (j->itemsize == 2)
            for (uint16_t k = 0; k < n; k++, off++, val += 2)
                memcpy(base + 2 * (size_t)*off, val, 2);
        else
            for (uint16_t k = 0; k < n; k++, off++, val += 4)
                memcpy(base + 4 * (size_t)*off, val, 4);
        if ((b + 1) % (HASH_CHUNK / PATCH_BLOCK) == 0 || b + 1 == j->blocks) { /* hash a chunk while in cache */
            int64_t from = (j->first_block + b / (HASH_CHUNK / PATCH_BLOCK) * (HASH_CHUNK / PATCH_BLOCK)) * PATCH_BLOCK;
            int64_t to = (j->first_block + b + 1) * PATCH_BLOCK < j->numel ? (j->first_block + b + 1) * PATCH_BLOCK
                                                                            : j->numel;
            crc_update(j->crc, j->dest + (size_t)from * j->itemsize, (size_t)(to - from) * j->itemsize);
        }
    }
    return NULL;
}

/* -1 when the counts, their sum and the last block's offsets fit a tensor of `numel` elements;
 * else the first bad block. Fills starts[t]: the changes before block t * per_job. */
static int64_t check_blocks(const uint16_t *counts, int64_t blocks, const uint8_t *offsets, int64_t count,
                            int64_t numel, int64_t per_job, int64_t *starts)
{
    int64_t seen = 0;
    for (int64_t b = 0; b < blocks; b++) {
        uint16_t n;
        memcpy(&n, &counts[b], sizeof n);
        if (b % per_job == 0)
            starts[b / per_job] = seen;
        int64_t room = numel - b * PATCH_BLOCK < PATCH_BLOCK ? numel - b * PATCH_BLOCK : PATCH_BLOCK;
        if (n > room || seen + n > count)
            return b;
        if (b == blocks - 1)
            for (int64_t k = seen; k < seen + n; k++)
                if (offsets[k] >= room)
                    return b;
        seen += n;
    }
    return seen == count ? -1 : blocks - 1;
}

static PyObject *deltadiff_apply_blocks(PyObject *self, PyObject *args)
{
    Py_buffer dest, counts, offsets, values, crc_view = {0};
    Py_ssize_t itemsize;
    int threads;
    uint64_t *crcs = NULL;
    if (!PyArg_ParseTuple(args, "w*ny*y*y*i|w*:apply_blocks", &dest, &itemsize, &counts, &offsets, &values, &threads,
                          &crc_view))
        return NULL;
    Py_buffer *views[] = {&dest, &counts, &offsets, &values, &crc_view};
    PyObject *result = NULL;
    int64_t numel = itemsize > 0 ? dest.len / itemsize : 0, count = offsets.len;
    int64_t blocks = counts.len / (Py_ssize_t)sizeof(uint16_t);
    if (!contiguous(views, 4) || !crcs_of(&crc_view, &crcs))
        ;
    else if ((itemsize != 2 && itemsize != 4) || dest.len % itemsize || counts.len % sizeof(uint16_t) ||
             blocks != (numel + PATCH_BLOCK - 1) / PATCH_BLOCK || values.len != count * itemsize ||
             ((uintptr_t)dest.buf % itemsize))
        PyErr_Format(PyExc_ValueError, "apply_blocks: itemsize %zd, dest %zd bytes, %zd count bytes, %zd offsets, "
                     "%zd value bytes (a uint16 count per %d elements, one value per offset)", itemsize, dest.len,
                     counts.len, offsets.len, values.len, PATCH_BLOCK);
    else {
        int n = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
        if (count < (int64_t)n * (MIN_PER_THREAD / 16))
            n = 1;
        int64_t per_job = (blocks + n - 1) / n, starts[MAX_THREADS] = {0}, bad;
        if (per_job < 1)
            per_job = 1;
        Py_BEGIN_ALLOW_THREADS
        bad = check_blocks(counts.buf, blocks, offsets.buf, count, numel, per_job, starts);
        if (bad < 0) {
            block_job jobs[MAX_THREADS];
            uint32_t running[MAX_THREADS];
            int64_t stops[MAX_THREADS];
            for (int t = 0; t < n; t++) {
                int64_t first = t * per_job < blocks ? t * per_job : blocks;
                int64_t last = first + per_job < blocks ? first + per_job : blocks;
                running[t] = 0xffffffffu;
                stops[t] = last * PATCH_BLOCK < numel ? last * PATCH_BLOCK : numel;
                jobs[t] = (block_job){dest.buf, (const uint16_t *)counts.buf + first,
                                      (const uint8_t *)offsets.buf + starts[t],
                                      (const char *)values.buf + starts[t] * itemsize, first, last - first, numel,
                                      (size_t)itemsize, crcs ? &running[t] : NULL};
            }
            run_jobs(scatter_blocks, (char *)jobs, sizeof(block_job), n);
            put_crcs(crcs, running, stops, n, numel, (size_t)itemsize);
        }
        Py_END_ALLOW_THREADS
        if (bad >= 0)
            PyErr_Format(PyExc_IndexError, "apply_blocks: block %lld's changes do not fit %lld elements "
                         "(or the counts do not add up to %lld)", (long long)bad, (long long)numel, (long long)count);
        else
            result = Py_NewRef(Py_None);
    }
    for (int k = 0; k < 5; k++)
        if (views[k]->obj != NULL)
            PyBuffer_Release(views[k]);
    return result;
}

static PyObject *deltadiff_portable(PyObject *self, PyObject *arg)
{
    int previous = !use_avx2;
    int on = PyObject_IsTrue(arg);
    if (on < 0)
        return NULL;
#if HAVE_AVX2_BUILD
    __builtin_cpu_init();
    use_avx2 = !on && __builtin_cpu_supports("avx2") != 0;
#endif
    return PyBool_FromLong(previous);
}

static PyMethodDef methods[] = {
    {"diff", deltadiff_diff, METH_VARARGS,
     "diff(new, base, itemsize, indices, values, threads[, crcs]) -> count: changed elements, baseline updated."},
    {"cast_diff", deltadiff_cast_diff, METH_VARARGS,
     "cast_diff(src_f32, base_bf16, indices, values, threads[, crcs]) -> count: diff of src rounded to bf16."},
    {"apply", deltadiff_apply, METH_VARARGS,
     "apply(dest, itemsize, indices, values, threads): dest[indices[k]] = values[k], every index checked first."},
    {"block_offsets", deltadiff_block_offsets, METH_VARARGS,
     "block_offsets(indices, counts, offsets): each 256-element block's count and each index's offset in it"},
    {"apply_blocks", deltadiff_apply_blocks, METH_VARARGS,
     "apply_blocks(dest, itemsize, counts, offsets, values, threads[, crcs]): write a blocks patch"},
    {"portable", deltadiff_portable, METH_O,
     "portable(on) -> previous: use the portable loops even where AVX2 is there (tests compare both)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "weightsync._native.deltadiff",
    "Delta sync's one-pass diff (see deltadiff.c).", -1, methods,
};

PyMODINIT_FUNC PyInit_deltadiff(void)
{
#if HAVE_AVX2_BUILD
    __builtin_cpu_init();
    use_avx2 = __builtin_cpu_supports("avx2") != 0;
#endif
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    crc_table_init();
#if HAVE_AVX2_BUILD
    shift_table_init();
#endif
    if (PyModule_AddIntConstant(m, "AVX2", use_avx2) < 0 || PyModule_AddIntConstant(m, "MAX_THREADS", MAX_THREADS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
