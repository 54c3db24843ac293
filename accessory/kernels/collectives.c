/* Collectives between the ranks of one machine through a shared memory segment: what gloo does over loopback TCP
   (about 1.2 ms an all-reduce here), in microseconds.

   The segment (parallel/shared_memory.py makes it, one per model-parallel group): a header, then for each rank two
   slots of `slot_bytes`. Every collective is a run of rounds; in round n each rank writes its part into its slot
   n % 2, posts n (its `posted` counter), waits until every rank has posted n, and reads the others' slots.

   Two slots are enough: a rank that posts round n + 1 has seen every rank post n, and each posted n only after it
   had read every slot of round n - 1, the slots that round n + 1 writes again. So no rank is ever more than one
   round ahead of another, and a round needs no second wait. Every rank adds the slots in rank order, so every rank
   ends with the same bits.

   With each round a rank posts what its collective is (kind, dtype, bytes, root: its `what` for that slot), and
   checks the others': ranks whose calls went out of step (one left a loop the others stay in) fail at once with
   both collectives named, instead of summing one's activations into another's counters.

   Waiting: spin for `spin_us` microseconds, then sleep on the counter (a futex, woken by the rank that posts) with
   a short timeout, in between checking that the awaited rank's process still lives (a rank killed mid-collective
   ends the others with an error naming it) and that `timeout_s` has not passed. With more ranks than cores, a
   spinner would hold the core the awaited rank needs: then the waiter `yields` as it spins (sched_yield gives the
   core to a rank that is ready to run, or returns at once), and only then sleeps. Sleeping at once costs more: a
   wake-up on another core takes tens of microseconds, every round, in a virtual machine.

   A waiter that sleeps lets go of Python's GIL if its thread holds it (an AOTInductor package's run does, while it
   calls these as operators): the rank's other Python threads, its watchdog's heartbeat among them, go on meanwhile,
   so a rank that waits long for another (compiling its step) is not taken for a frozen one.

   Errors: each call returns 0, or -1 with a message for accessory_shm_error(): -2 where the ranks are in different
   collectives. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() __asm__ __volatile__("" ::: "memory")
#endif

#define MAX_RANKS 64
#define MAX_GROUPS 16
#define LINE 64
#define MAGIC 0x6163636573736d31ull /* "accessm1" */
#define NAP_NS 20000000L            /* one sleep on a futex: 20 ms, then the liveness and deadline checks */

typedef struct {
    _Atomic uint32_t posted;   /* the last round this rank posted */
    _Atomic uint32_t sleepers; /* ranks asleep on `posted` */
    int32_t pid;
    int32_t unused;
    uint64_t what[2];          /* the collective of the round in each slot (what_of) */
    char pad[LINE - 32];
} RankState;
_Static_assert(sizeof(RankState) == LINE, "one cache line a rank");

typedef struct {
    uint64_t magic;
    int64_t slot_bytes;
    int32_t world;
    char pad[LINE - 20];
    RankState ranks[MAX_RANKS];
} Header;

#define DATA_OFFSET (((sizeof(Header) + 4095) / 4096) * 4096)

typedef struct {
    char *base;
    int64_t bytes, slot_bytes, spin_ns, sent; /* sent: what this rank wrote into its slots, for the others */
    int rank, world, yields;
    uint32_t round;
    double timeout_s, waited_s; /* waited_s: time spent waiting for other ranks to post */
} Group;

static Group groups[MAX_GROUPS];
static __thread char error_message[512];

const char *accessory_shm_error(void) { return error_message; }

int64_t accessory_shm_segment_bytes(int world, int64_t slot_bytes) {
    return (int64_t)DATA_OFFSET + (int64_t)world * 2 * slot_bytes;
}

static Header *header(const Group *g) { return (Header *)g->base; }

static char *slot(const Group *g, int rank, uint32_t round) {
    return g->base + DATA_OFFSET + ((int64_t)rank * 2 + (round & 1)) * g->slot_bytes;
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* Map the segment open as `fd` (bytes long) as `rank` of `world`; the first rank to map it writes its header (rank
   0, before the others are told its name). Returns a handle >= 0, or -1. */
int accessory_shm_attach(int fd, int64_t bytes, int rank, int world, int64_t slot_bytes, double spin_us, int yields,
                         double timeout_s) {
    int handle = 0;
    while (handle < MAX_GROUPS && groups[handle].base != NULL) handle++;
    if (handle == MAX_GROUPS || world < 1 || world > MAX_RANKS || rank < 0 || rank >= world || slot_bytes < 64 ||
        slot_bytes % 64 || bytes != accessory_shm_segment_bytes(world, slot_bytes)) {
        snprintf(error_message, sizeof error_message,
                 "cannot attach rank %d of %d (slots of %lld bytes, a segment of %lld; %d groups at most)", rank, world,
                 (long long)slot_bytes, (long long)bytes, MAX_GROUPS);
        return -1;
    }
    char *base = mmap(NULL, (size_t)bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) {
        snprintf(error_message, sizeof error_message, "mmap of %lld bytes failed: %s", (long long)bytes,
                 strerror(errno));
        return -1;
    }
    Header *h = (Header *)base;
    if (rank == 0) {
        h->slot_bytes = slot_bytes;
        h->world = world;
        atomic_store(&((Header *)base)->ranks[0].posted, 0);
        __atomic_store_n(&h->magic, MAGIC, __ATOMIC_SEQ_CST);
    } else if (__atomic_load_n(&h->magic, __ATOMIC_SEQ_CST) != MAGIC || h->world != world ||
               h->slot_bytes != slot_bytes) {
        munmap(base, (size_t)bytes);
        snprintf(error_message, sizeof error_message, "the segment is not one of %d ranks with slots of %lld bytes",
                 world, (long long)slot_bytes);
        return -1;
    }
    h->ranks[rank].pid = (int32_t)getpid();
    groups[handle] = (Group){base, bytes, slot_bytes, (int64_t)(spin_us * 1e3), 0, rank, world, yields != 0, 0,
                             timeout_s, 0.0};
    return handle;
}

int64_t accessory_shm_bytes_sent(int handle) {
    return handle >= 0 && handle < MAX_GROUPS && groups[handle].base != NULL ? groups[handle].sent : -1;
}

double accessory_shm_waited_s(int handle) {
    return handle >= 0 && handle < MAX_GROUPS && groups[handle].base != NULL ? groups[handle].waited_s : -1.0;
}

void accessory_shm_detach(int handle) {
    if (handle >= 0 && handle < MAX_GROUPS && groups[handle].base != NULL) {
        munmap(groups[handle].base, (size_t)groups[handle].bytes);
        groups[handle].base = NULL;
    }
}

static Group *group_of(int handle) {
    if (handle < 0 || handle >= MAX_GROUPS || groups[handle].base == NULL) {
        snprintf(error_message, sizeof error_message, "no shared-memory group %d in this process", handle);
        return NULL;
    }
    return &groups[handle];
}

static int reached(const RankState *s, uint32_t round) {
    return (int32_t)(atomic_load_explicit(&s->posted, memory_order_acquire) - round) >= 0;
}

/* Whether process `pid` has ended (gone, or a zombie its parent has not yet reaped). */
static int ended(int32_t pid) {
    if (kill(pid, 0) != 0) return errno == ESRCH;
    char path[64], state = 0;
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    FILE *f = fopen(path, "r");
    if (f == NULL) return 1;
    int n = fscanf(f, "%*d (%*[^)]) %c", &state);
    fclose(f);
    return n == 1 && (state == 'Z' || state == 'X');
}

/* Python's GIL, if this process runs Python and this thread holds it: let go before sleeping, take it back after
   (found at run time: the library does not link against Python). */
typedef struct {
    int (*held)(void);
    void *(*release)(void);
    void (*restore)(void *);
} Gil;

static Gil gil_api(void) {
    static Gil gil;
    static int looked;
    if (!looked) {
        gil.held = (int (*)(void))dlsym(RTLD_DEFAULT, "PyGILState_Check");
        gil.release = (void *(*)(void))dlsym(RTLD_DEFAULT, "PyEval_SaveThread");
        gil.restore = (void (*)(void *))dlsym(RTLD_DEFAULT, "PyEval_RestoreThread");
        looked = 1;
    }
    return gil;
}

static int sleep_for(const Group *g, int rank, uint32_t round, double timeout_s);

static int spin_or_sleep(const Group *g, int rank, uint32_t round, double timeout_s, double start) {
    RankState *s = &header(g)->ranks[rank];
    const double until = start + g->spin_ns * 1e-9;
    for (int i = 1;; i++) {
        if (g->yields)
            sched_yield();
        else
            CPU_RELAX();
        if (reached(s, round)) return 0;
        if ((g->yields || i % 64 == 0) && now_s() > until) break;
    }
    const Gil gil = gil_api();
    void *thread = gil.held && gil.release && gil.restore && gil.held() ? gil.release() : NULL;
    const int failed = sleep_for(g, rank, round, timeout_s);
    if (thread != NULL) gil.restore(thread);
    return failed;
}

static int wait_for(Group *g, int rank, uint32_t round, double timeout_s) {
    if (reached(&header(g)->ranks[rank], round)) return 0;
    const double start = now_s();
    const int failed = spin_or_sleep(g, rank, round, timeout_s, start);
    g->waited_s += now_s() - start;
    return failed;
}

static int sleep_for(const Group *g, int rank, uint32_t round, double timeout_s) {
    RankState *s = &header(g)->ranks[rank];
    const double start = now_s();
    for (;;) {
        atomic_fetch_add(&s->sleepers, 1);
        const uint32_t seen = atomic_load(&s->posted);
        if ((int32_t)(seen - round) < 0) {
            struct timespec nap = {0, NAP_NS};
            syscall(SYS_futex, &s->posted, FUTEX_WAIT, seen, &nap, NULL, 0);
        }
        atomic_fetch_sub(&s->sleepers, 1);
        if (reached(s, round)) return 0;
        if (ended(s->pid)) {
            snprintf(error_message, sizeof error_message,
                     "model-parallel rank %d (pid %d) ended during a shared-memory collective", rank, s->pid);
            return -1;
        }
        if (now_s() - start > timeout_s) {
            snprintf(error_message, sizeof error_message,
                     "model-parallel rank %d did not reach a shared-memory collective: timed out after %g s", rank,
                     timeout_s);
            return -1;
        }
    }
}

/* ---- which collective a round belongs to ------------------------------------------------------------------------ */

enum { ALL_REDUCE = 1, ALL_GATHER, GATHER, BROADCAST };
static const char *const KIND_NAMES[] = {"?", "an all-reduce", "an all-gather", "a gather", "a broadcast"};
static const char *const DTYPE_NAMES[] = {"float32", "float64", "bfloat16", "float16", "int32", "int64", "bytes"};
#define RAW 6 /* the dtype of a collective that only moves bytes */

/* kind (4 bits), dtype (4), root rank (8), total bytes (48) */
static uint64_t what_of(int kind, int dtype, int root, int64_t bytes) {
    return (uint64_t)kind << 60 | (uint64_t)dtype << 56 | (uint64_t)(root & 0xff) << 48 |
           ((uint64_t)bytes & 0xffffffffffffull);
}

static int describe(char *out, size_t size, uint64_t what) {
    const int kind = (int)(what >> 60), dtype = (int)(what >> 56 & 0xf), root = (int)(what >> 48 & 0xff);
    const long long bytes = (long long)(what & 0xffffffffffffull);
    const char *name = kind >= ALL_REDUCE && kind <= BROADCAST ? KIND_NAMES[kind] : KIND_NAMES[0];
    const char *type = dtype <= RAW ? DTYPE_NAMES[dtype] : "?";
    if (kind == GATHER || kind == BROADCAST)
        return snprintf(out, size, "%s of %lld %s %s rank %d", name, bytes, type, kind == GATHER ? "to" : "from",
                        root);
    return snprintf(out, size, "%s of %lld %s", name, bytes, type);
}

/* The others' collective in the round just completed is this rank's, or -2 with both named. */
static int same_collective(const Group *g, uint32_t round) {
    const uint64_t mine = header(g)->ranks[g->rank].what[round & 1];
    for (int r = 0; r < g->world; r++) {
        const uint64_t theirs = header(g)->ranks[r].what[round & 1];
        if (theirs == mine) continue;
        char a[160], b[160];
        describe(a, sizeof a, mine);
        describe(b, sizeof b, theirs);
        snprintf(error_message, sizeof error_message,
                 "the model-parallel ranks are not in the same collective: rank %d is in %s, rank %d in %s", g->rank,
                 a, r, b);
        return -2;
    }
    return 0;
}

/* Post the next round (this rank's slot is written) as part of collective `what`, wait until every rank has, and
   check that theirs is the same collective. */
static int round_trip(Group *g, uint64_t what, double timeout_s) {
    const uint32_t round = ++g->round;
    RankState *mine = &header(g)->ranks[g->rank];
    mine->what[round & 1] = what;
    atomic_store(&mine->posted, round); /* release: the slot and `what` are visible before the count */
    if (atomic_load(&mine->sleepers)) syscall(SYS_futex, &mine->posted, FUTEX_WAKE, 0x7fffffff, NULL, NULL, 0);
    for (int r = 0; r < g->world; r++)
        if (r != g->rank && wait_for(g, r, round, timeout_s)) return -1;
    return same_collective(g, round);
}

static double timeout_or_default(const Group *g, double timeout_s) { return timeout_s > 0 ? timeout_s : g->timeout_s; }

/* ---- sums in rank order --------------------------------------------------------------------------------------- */

enum { F32, F64, BF16, F16, I32, I64 };

static int element_bytes(int dtype) {
    switch (dtype) {
    case F32: case I32: return 4;
    case F64: case I64: return 8;
    case BF16: case F16: return 2;
    default: return 0;
    }
}

static float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static uint16_t float_to_bf16(float f) { /* round to nearest even, NaN kept a NaN */
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1)) >> 16);
}

#define SUM_LOOP(type, acc_type, load, store)                                                                     \
    do {                                                                                                          \
        type *o = (type *)out;                                                                                    \
        for (int64_t i = 0; i < n; i++) {                                                                         \
            acc_type acc = load(((const type *)parts[0])[i]);                                                     \
            for (int r = 1; r < world; r++) acc += load(((const type *)parts[r])[i]);                             \
            o[i] = store(acc);                                                                                    \
        }                                                                                                         \
    } while (0)
#define SAME(x) (x)
#define HALF_IN(x) ((float)(x))
#define HALF_OUT(x) ((_Float16)(x))

static void sum_parts(int dtype, const char *const *parts, int world, char *out, int64_t n) {
    switch (dtype) {
    case F32:
        if (world == 2) { /* the common case, in one pass the compiler vectorises */
            const float *a = (const float *)parts[0], *b = (const float *)parts[1];
            float *o = (float *)out;
            for (int64_t i = 0; i < n; i++) o[i] = a[i] + b[i];
        } else {
            SUM_LOOP(float, float, SAME, SAME);
        }
        break;
    case F64: SUM_LOOP(double, double, SAME, SAME); break;
    case I32: SUM_LOOP(int32_t, int32_t, SAME, SAME); break;
    case I64: SUM_LOOP(int64_t, int64_t, SAME, SAME); break;
    case BF16: SUM_LOOP(uint16_t, float, bf16_to_float, float_to_bf16); break;
    case F16: SUM_LOOP(_Float16, float, HALF_IN, HALF_OUT); break;
    }
}

/* ---- the collectives ------------------------------------------------------------------------------------------ */

/* out (n elements of `dtype`) = the sum of every rank's in; in and out may be the same memory. */
int accessory_shm_all_reduce(int handle, const void *in, void *out, int64_t n, int dtype, double timeout_s) {
    Group *g = group_of(handle);
    const int size = element_bytes(dtype);
    if (g == NULL) return -1;
    if (size == 0) {
        snprintf(error_message, sizeof error_message, "all-reduce of an unsupported dtype (%d)", dtype);
        return -1;
    }
    timeout_s = timeout_or_default(g, timeout_s);
    const uint64_t what = what_of(ALL_REDUCE, dtype, 0, n * size);
    const int64_t per_round = g->slot_bytes / size;
    const char *parts[MAX_RANKS];
    for (int64_t done = 0; done < n; done += per_round) {
        const int64_t count = n - done < per_round ? n - done : per_round;
        memcpy(slot(g, g->rank, g->round + 1), (const char *)in + done * size, (size_t)(count * size));
        g->sent += count * size;
        const int failed = round_trip(g, what, timeout_s);
        if (failed) return failed;
        for (int r = 0; r < g->world; r++) parts[r] = slot(g, r, g->round);
        sum_parts(dtype, parts, g->world, (char *)out + done * size, count);
    }
    return 0;
}

/* out (world * bytes) = every rank's `bytes` of in, in rank order. */
int accessory_shm_all_gather(int handle, const void *in, void *out, int64_t bytes, double timeout_s) {
    Group *g = group_of(handle);
    if (g == NULL) return -1;
    timeout_s = timeout_or_default(g, timeout_s);
    const uint64_t what = what_of(ALL_GATHER, RAW, 0, bytes);
    for (int64_t done = 0; done < bytes; done += g->slot_bytes) {
        const int64_t count = bytes - done < g->slot_bytes ? bytes - done : g->slot_bytes;
        memcpy(slot(g, g->rank, g->round + 1), (const char *)in + done, (size_t)count);
        g->sent += count;
        const int failed = round_trip(g, what, timeout_s);
        if (failed) return failed;
        for (int r = 0; r < g->world; r++) memcpy((char *)out + r * bytes + done, slot(g, r, g->round), (size_t)count);
    }
    return 0;
}

/* On `dst` only, out (world * bytes) = every rank's `bytes` of in, in rank order (out is not touched elsewhere). */
int accessory_shm_gather(int handle, const void *in, void *out, int64_t bytes, int dst, double timeout_s) {
    Group *g = group_of(handle);
    if (g == NULL) return -1;
    timeout_s = timeout_or_default(g, timeout_s);
    const uint64_t what = what_of(GATHER, RAW, dst, bytes);
    for (int64_t done = 0; done < bytes; done += g->slot_bytes) {
        const int64_t count = bytes - done < g->slot_bytes ? bytes - done : g->slot_bytes;
        memcpy(slot(g, g->rank, g->round + 1), (const char *)in + done, (size_t)count);
        g->sent += g->rank == dst ? 0 : count;
        const int failed = round_trip(g, what, timeout_s);
        if (failed) return failed;
        if (g->rank == dst)
            for (int r = 0; r < g->world; r++)
                memcpy((char *)out + r * bytes + done, slot(g, r, g->round), (size_t)count);
    }
    return 0;
}

/* Every rank's data (bytes) = rank src's. */
int accessory_shm_broadcast(int handle, void *data, int64_t bytes, int src, double timeout_s) {
    Group *g = group_of(handle);
    if (g == NULL) return -1;
    timeout_s = timeout_or_default(g, timeout_s);
    const uint64_t what = what_of(BROADCAST, RAW, src, bytes);
    for (int64_t done = 0; done < bytes; done += g->slot_bytes) {
        const int64_t count = bytes - done < g->slot_bytes ? bytes - done : g->slot_bytes;
        if (g->rank == src) {
            memcpy(slot(g, src, g->round + 1), (const char *)data + done, (size_t)count);
            g->sent += count;
        }
        const int failed = round_trip(g, what, timeout_s);
        if (failed) return failed;
        if (g->rank != src) memcpy((char *)data + done, slot(g, src, g->round), (size_t)count);
    }
    return 0;
}
