/* Gemma's tokenizer (a SentencePiece BPE converted for Hugging Face `tokenizers`) in plain C, to the id: what
   tokenizers' AddedVocabulary split, Replace(" " -> "▁") normaliser and BPE (merge_word + Word::merge_all, byte
   fallback) do for a model egemma/kernels/bpe.py has checked has exactly that pipeline. No allocation per character or
   token and no Python object per id: ids go straight into the caller's int32 buffer. Pieces of a batch run on a
   small persistent thread pool (the caller works too); the reference is tokenizers itself (tests/test_bpe.py). */
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define NCP 0x110000
#define EMPTY UINT64_MAX

typedef struct { uint64_t key; int32_t rank, id; } Merge;     /* key = left id << 32 | right id */
typedef struct { uint64_t key; int32_t a, b, id, pad; } Entry; /* key = rank << 32 | position: popped smallest first */

/* A word's ids, cached by the word's bytes in two cache lines (64-byte aligned), direct-mapped (a collision replaces), shared by the
   pool's threads: seq is a seqlock (odd while written; a reader keeps what it copied only if seq did not move). */
#define WORD_BYTES 50
#define WORD_IDS 18
#define CACHE_SLOTS 32768
typedef struct { atomic_uint seq; uint8_t len, n, bytes[WORD_BYTES]; int32_t ids[WORD_IDS]; } Slot;

typedef struct Model Model;
typedef struct {
    int32_t *id, *prev, *next;
    Entry *heap;
    size_t cap;
} Scratch;

/* One call: texts cut into pieces at safe cuts, the pieces spread over the pool. */
typedef struct {
    Model *m;
    const uint8_t *text;
    int32_t *out;
    long n;              /* pieces */
    int64_t *lo, *count; /* per piece: [lo[p], lo[p + 1]) of text, ids written to out + lo[p]; their number */
    atomic_long next;
} Job;

struct Model {
    int32_t *cp;               /* [NCP] id of the one-character token, -1 if none */
    int32_t byte[256];         /* <0xXX> */
    Merge *merges;
    uint64_t mmask;
    /* added tokens as a byte trie: node 0 the root; children in a sibling list; tok: id ending here, or -1 */
    uint8_t *tbyte;
    int32_t *tchild, *tnext, *ttok;
    uint8_t first[256];        /* a byte that starts some added token */
    uint8_t *glued;            /* [NCP]: 1 after a character where a " " is no safe cut (egemma.engine.chunker) */
    Slot *cache;               /* [CACHE_SLOTS] */
    /* pool */
    int nthreads;
    pthread_t *threads;
    Scratch *scratch;          /* [nthreads + 1]: the caller's is the last */
    _Atomic(Job *) job;        /* the call's, while it hands out pieces */
    atomic_uint generation;    /* a futex: bumped per call that wakes workers */
    atomic_int active;         /* workers inside a call's job */
    atomic_int stop;           /* bpe_free: workers return */
};

static inline uint64_t mix(uint64_t x) { return (x * 0x9E3779B97F4A7C15ull) ^ (x >> 29); }

static uint64_t hash_bytes(const uint8_t *s, int n) {
    uint64_t h = 1469598103934665603ull;
    for (int i = 0; i < n; i++) h = (h ^ s[i]) * 1099511628211ull;
    return mix(h);
}

static inline const Merge *merge_find(const Model *m, int32_t a, int32_t b) {
    uint64_t key = (uint64_t)(uint32_t)a << 32 | (uint32_t)b;
    for (uint64_t i = mix(key) & m->mmask;; i = (i + 1) & m->mmask) {
        const Merge *e = &m->merges[i];
        if (e->key == key) return e;
        if (e->key == EMPTY) return NULL;
    }
}

static int32_t child(const Model *m, int32_t node, uint8_t b) {
    for (int32_t c = m->tchild[node]; c >= 0; c = m->tnext[c])
        if (m->tbyte[c] == b) return c;
    return -1;
}

/* The longest added token at t[0:n]: its id and *len, or -1. */
static int32_t added_at(const Model *m, const uint8_t *t, long n, long *len) {
    int32_t node = 0, id = -1;
    for (long j = 0; j < n && (node = child(m, node, t[j])) >= 0; j++)
        if (m->ttok[node] >= 0) { id = m->ttok[node]; *len = j + 1; }
    return id;
}

static int reserve(Scratch *s, size_t n) {
    if (n <= s->cap) return 0;
    size_t cap = n < 4096 ? 4096 : n * 2;
    int32_t *id = realloc(s->id, cap * 4), *prev = realloc(s->prev, cap * 4), *next = realloc(s->next, cap * 4);
    Entry *heap = realloc(s->heap, 3 * cap * sizeof(Entry));
    if (id) s->id = id;
    if (prev) s->prev = prev;
    if (next) s->next = next;
    if (heap) s->heap = heap;
    if (!id || !prev || !next || !heap) return -1;
    s->cap = cap;
    return 0;
}

static void heap_push(Entry *h, long *n, Entry e) {
    long i = (*n)++;
    while (i > 0) {
        long p = (i - 1) / 2;
        if (h[p].key <= e.key) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = e;
}

static Entry heap_pop(Entry *h, long *n) {
    Entry top = h[0], last = h[--*n];
    long i = 0;
    for (;;) {
        long c = 2 * i + 1;
        if (c >= *n) break;
        if (c + 1 < *n && h[c + 1].key < h[c].key) c++;
        if (last.key <= h[c].key) break;
        h[i] = h[c];
        i = c;
    }
    h[i] = last;
    return top;
}

static inline void push_pair(const Model *m, Scratch *s, long *nh, int32_t pos) {
    int32_t nx = s->next[pos];
    if (nx < 0) return;
    const Merge *e = merge_find(m, s->id[pos], s->id[nx]);
    if (e) heap_push(s->heap, nh, (Entry){(uint64_t)e->rank << 32 | (uint32_t)pos, s->id[pos], s->id[nx], e->id, 0});
}

/* The character of the len bytes at t (valid UTF-8: Python encoded it). */
static inline uint32_t utf8(const uint8_t *t, int len) {
    if (len == 1) return t[0];
    if (len == 2) return (t[0] & 0x1Fu) << 6 | (t[1] & 0x3F);
    if (len == 3) return (t[0] & 0x0Fu) << 12 | (t[1] & 0x3F) << 6 | (t[2] & 0x3F);
    return (t[0] & 0x07u) << 18 | (t[1] & 0x3F) << 12 | (t[2] & 0x3F) << 6 | (t[3] & 0x3F);
}

/* One word (a normalised segment between added tokens): characters -> symbols, then the lowest-ranked merge,
   leftmost first, until none applies; a queue entry is stale when its pair no longer produces its id (as
   tokenizers checks it). Returns the ids written. */
static long bpe_word(const Model *m, Scratch *s, const uint8_t *t, long n, int32_t *out) {
    long k = 0, i = 0;
    while (i < n) {
        int len = t[i] < 0x80 ? 1 : t[i] < 0xE0 ? 2 : t[i] < 0xF0 ? 3 : 4;
        uint32_t c = utf8(t + i, len);
        if (c == ' ') c = 0x2581; /* the normaliser */
        int32_t id = c < NCP ? m->cp[c] : -1;
        if (id >= 0) s->id[k++] = id; /* "▁" always has one (egemma/kernels/bpe.py checks) */
        else
            for (int j = 0; j < len; j++) s->id[k++] = m->byte[t[i + j]];
        i += len;
    }
    for (long j = 0; j < k; j++) { s->prev[j] = j - 1; s->next[j] = j + 1 < k ? j + 1 : -1; }
    long nh = 0;
    for (long j = 0; j + 1 < k; j++) push_pair(m, s, &nh, j);
    while (nh) {
        Entry e = heap_pop(s->heap, &nh);
        int32_t pos = (int32_t)e.key, nx = s->next[pos];
        if (s->id[pos] < 0 || nx < 0) continue; /* merged away, or last */
        if (s->id[pos] != e.a || s->id[nx] != e.b) {
            const Merge *cur = merge_find(m, s->id[pos], s->id[nx]);
            if (!cur || cur->id != e.id) continue;
        }
        s->id[pos] = e.id;
        s->id[nx] = -1;
        s->next[pos] = s->next[nx];
        if (s->next[nx] >= 0) s->prev[s->next[nx]] = pos;
        if (s->prev[pos] >= 0) push_pair(m, s, &nh, s->prev[pos]);
        push_pair(m, s, &nh, pos);
    }
    long w = 0;
    for (long j = 0; j >= 0 && k; j = s->next[j]) out[w++] = s->id[j];
    return w;
}

/* The character ending at t[p - 1] (UTF-8). */
static uint32_t char_before(const uint8_t *t, long p) {
    long i = p - 1;
    while (i > 0 && (t[i] & 0xC0) == 0x80) i--;
    return utf8(t + i, (int)(p - i));
}

/* The first safe cut at or after p in t[a:b] (b if none): a " " after a character not glued to "▁". */
static long cut(const Model *m, const uint8_t *t, long a, long b, long p) {
    for (; p < b; p++)
        if (t[p] == ' ' && p > a && !m->glued[char_before(t, p)]) return p;
    return b;
}

static long cached_word(const Model *m, Scratch *s, const uint8_t *t, long n, int32_t *out) {
    if (n > WORD_BYTES) return bpe_word(m, s, t, n, out);
    Slot *c = &m->cache[hash_bytes(t, (int)n) & (CACHE_SLOTS - 1)];
    unsigned seq = atomic_load_explicit(&c->seq, memory_order_acquire);
    if (!(seq & 1) && c->len == n && !memcmp(c->bytes, t, n)) {
        int32_t ids[WORD_IDS];
        int k = c->n < WORD_IDS ? c->n : WORD_IDS;
        if (k > n) k = (int)n; /* a torn read is thrown away below; never copy more ids than the word has bytes */
        memcpy(ids, c->ids, k * sizeof(int32_t));
        atomic_thread_fence(memory_order_acquire);
        if (atomic_load_explicit(&c->seq, memory_order_relaxed) == seq) {
            memcpy(out, ids, k * sizeof(int32_t));
            return k;
        }
    }
    long w = bpe_word(m, s, t, n, out);
    if (w <= WORD_IDS && !(seq & 1) && atomic_compare_exchange_strong(&c->seq, &seq, seq + 1)) {
        atomic_thread_fence(memory_order_release); /* the odd seq is seen before any of the new bytes */
        c->len = (uint8_t)n;
        c->n = (uint8_t)w;
        memcpy(c->bytes, t, n);
        memcpy(c->ids, out, w * sizeof(int32_t));
        atomic_store_explicit(&c->seq, seq + 2, memory_order_release);
    }
    return w;
}

/* A segment between added tokens, as words: it is cut before each " " that follows a character no token glues
   to "▁" (the Chunker's safe cuts: no merge spans one), so common words come from the cache. */
static long segment(const Model *m, Scratch *s, const uint8_t *t, long n, int32_t *out) {
    long w = 0, start = 0;
    for (long p = cut(m, t, 0, n, 1); p < n; p = cut(m, t, 0, n, p + 1)) {
        w += cached_word(m, s, t + start, p - start, out + w);
        start = p;
    }
    return w + (n > start ? cached_word(m, s, t + start, n - start, out + w) : 0);
}

/* One piece of text: split on added tokens (leftmost, then longest), BPE between them. At most one id per byte. */
static long encode_piece(const Model *m, Scratch *s, const uint8_t *t, long n, int32_t *out) {
    if (reserve(s, (size_t)n + 1)) return -1;
    long w = 0, start = 0, len = 0;
    for (long i = 0; i < n;) {
        int32_t id = m->first[t[i]] ? added_at(m, t + i, n - i, &len) : -1;
        if (id < 0) { i++; continue; }
        w += segment(m, s, t + start, i - start, out + w);
        out[w++] = id;
        i += len;
        start = i;
    }
    return w + segment(m, s, t + start, n - start, out + w);
}

static void work(Job *j, Scratch *s) {
    long p;
    while ((p = atomic_fetch_add(&j->next, 1)) < j->n)
        j->count[p] = encode_piece(j->m, s, j->text + j->lo[p], j->lo[p + 1] - j->lo[p], j->out + j->lo[p]);
}

static void futex(atomic_uint *word, int op, unsigned val) { syscall(SYS_futex, word, op, val, NULL, NULL, 0); }

/* Workers sleep on the generation; one woken joins the call's job if it is still there. A worker counts itself
   active before it reads the job and the caller clears the job before it waits for none to be active, so no
   worker ever holds a job whose call has returned. A worker reads stop before each sleep: bpe_free may stop the
   pool and bump the generation before a new thread first reads it, and then no wake-up would ever come (a model
   freed right after it was made hung so, tests/test_bpe.py). */
static void *worker(void *arg) {
    void **a = arg;
    Model *m = a[0];
    Scratch *s = a[1];
    free(a);
    unsigned seen = atomic_load(&m->generation);
    for (;;) {
        if (atomic_load(&m->stop)) return NULL;
        futex(&m->generation, FUTEX_WAIT_PRIVATE, seen);
        unsigned g = atomic_load(&m->generation);
        if (g == seen) continue; /* spurious */
        seen = g;
        atomic_fetch_add(&m->active, 1);
        Job *j = atomic_load(&m->job);
        if (j) work(j, s);
        atomic_fetch_sub(&m->active, 1);
    }
}

/* Texts i = 0..n-1 are text[off[i]:off[i+1]] (UTF-8); text i's ids go to out[off[i]:], their number to
   count[i] (-1: out of memory). Each text is cut into pieces of about chunk bytes (>= 1) where the ids cannot
   change, in one pass here, and the pieces are spread over the pool: about one thread per 2 KB beyond the
   caller's share is woken, since waking one costs more than a short text. One call at a time per model. A
   forked child (which has none of the pool's threads) does all the work on its calling thread, unless it was
   forked while a call was in flight. */
void bpe_encode(Model *m, const uint8_t *text, const int64_t *off, long n, long chunk, int32_t *out, int64_t *count) {
    long most = n + (off[n] - off[0]) / chunk + 1;
    int64_t *lo = malloc(2 * (most + 1) * sizeof(int64_t)), *first = malloc((n + 1) * sizeof(int64_t));
    if (!lo || !first) {
        free(lo);
        free(first);
        for (long i = 0; i < n; i++) count[i] = -1;
        return;
    }
    long pieces = 0;
    for (long i = 0; i < n; i++) {
        first[i] = pieces;
        long a = off[i], b = off[i + 1], start = a;
        do {
            lo[pieces++] = start;
            start = cut(m, text, a, b, start + chunk < b ? start + chunk : b);
        } while (start < b);
    }
    first[n] = pieces;
    lo[pieces] = off[n];
    Job j = {m, text, out, pieces, lo, lo + most + 1, 0};
    long wake = (off[n] - off[0]) >> 11;
    if (wake > pieces - 1) wake = pieces - 1;
    if (wake > m->nthreads) wake = m->nthreads;
    if (wake > 0) {
        atomic_store(&m->job, &j);
        atomic_fetch_add(&m->generation, 1);
        futex(&m->generation, FUTEX_WAKE_PRIVATE, (unsigned)wake);
    }
    work(&j, &m->scratch[m->nthreads]);
    if (wake > 0) { /* every piece is taken: let no late worker join, then wait for those still on one */
        atomic_store(&m->job, NULL);
        while (atomic_load(&m->active)) sched_yield();
    }
    for (long i = 0; i < n; i++) { /* each text's pieces' ids, moved together */
        int64_t w = off[i];
        for (long p = first[i]; p < first[i + 1] && w >= 0; p++) {
            if (j.count[p] < 0) { w = -1; break; }
            memmove(out + w, out + lo[p], j.count[p] * sizeof(int32_t));
            w += j.count[p];
        }
        count[i] = w < 0 ? -1 : w - off[i];
    }
    free(lo);
    free(first);
}

/* The pool stopped and joined, everything freed; m may be partly built (bpe_new's failures). */
void bpe_free(Model *m) {
    if (!m) return;
    atomic_store(&m->stop, 1);
    atomic_fetch_add(&m->generation, 1);
    futex(&m->generation, FUTEX_WAKE_PRIVATE, (unsigned)m->nthreads + 1);
    for (int t = 0; t < m->nthreads; t++) pthread_join(m->threads[t], NULL);
    for (int t = 0; m->scratch && t <= m->nthreads; t++) {
        Scratch *s = &m->scratch[t];
        free(s->id);
        free(s->prev);
        free(s->next);
        free(s->heap);
    }
    free(m->scratch);
    free(m->threads);
    free(m->cp);
    free(m->glued);
    free(m->merges);
    free(m->cache);
    free(m->tbyte);
    free(m->tchild);
    free(m->tnext);
    free(m->ttok);
    free(m);
}

/* cp: [NCP] one-character token ids (-1 none); byte: [256]; merges: (left, right, merged id) x nm, rank = index,
   a repeated pair keeping its last rank; added: nadd contents (concatenated, aoff[nadd + 1]) and their ids;
   glued: the characters after which a " " is no safe cut; nthreads: pool threads beside the caller. The arrays
   are copied. NULL when out of memory. A model and its threads live as long as the process. */
Model *bpe_new(const int32_t *cp, const int32_t *byte, const int32_t *merges, long nm, const uint8_t *added,
               const int32_t *aoff, const int32_t *aid, long nadd, const uint32_t *glued, int nglued, int nthreads) {
    Model *m = calloc(1, sizeof *m);
    if (!m) return NULL;
    if (!(m->glued = calloc(NCP, 1))) { free(m); return NULL; }
    for (int i = 0; i < nglued; i++) m->glued[glued[i]] = 1;
    m->cp = malloc(NCP * 4);
    uint64_t ms = 1;
    while (ms < 2 * (uint64_t)nm + 2) ms <<= 1;
    m->merges = malloc(ms * sizeof(Merge));
    m->mmask = ms - 1;
    long nodes = aoff[nadd] + 1;
    m->tbyte = malloc(nodes);
    m->tchild = malloc(nodes * 4);
    m->tnext = malloc(nodes * 4);
    m->ttok = malloc(nodes * 4);
    if ((m->cache = aligned_alloc(64, CACHE_SLOTS * sizeof(Slot)))) memset(m->cache, 0, CACHE_SLOTS * sizeof(Slot));
    m->nthreads = nthreads;
    m->threads = calloc(nthreads + 1, sizeof(pthread_t));
    m->scratch = calloc(nthreads + 1, sizeof(Scratch));
    if (!m->cp || !m->merges || !m->cache || !m->tbyte || !m->tchild || !m->tnext || !m->ttok || !m->threads ||
        !m->scratch) {
        m->nthreads = 0;
        bpe_free(m);
        return NULL;
    }
    memcpy(m->cp, cp, NCP * 4);
    memcpy(m->byte, byte, sizeof m->byte);
    for (uint64_t i = 0; i < ms; i++) m->merges[i].key = EMPTY;
    for (long r = 0; r < nm; r++) {
        uint64_t key = (uint64_t)(uint32_t)merges[3 * r] << 32 | (uint32_t)merges[3 * r + 1];
        uint64_t i = mix(key) & m->mmask;
        while (m->merges[i].key != EMPTY && m->merges[i].key != key) i = (i + 1) & m->mmask;
        m->merges[i] = (Merge){key, (int32_t)r, merges[3 * r + 2]};
    }
    long used = 1;
    m->tchild[0] = m->tnext[0] = m->ttok[0] = -1;
    for (long k = 0; k < nadd; k++) {
        int32_t node = 0;
        for (int32_t j = aoff[k]; j < aoff[k + 1]; j++) {
            int32_t c = child(m, node, added[j]);
            if (c < 0) {
                c = (int32_t)used++;
                m->tbyte[c] = added[j];
                m->tchild[c] = m->ttok[c] = -1;
                m->tnext[c] = m->tchild[node];
                m->tchild[node] = c;
            }
            node = c;
        }
        if (node && m->ttok[node] < 0) m->ttok[node] = aid[k]; /* the first of equal contents wins */
        if (node) m->first[added[aoff[k]]] = 1;
    }
    for (int t = 0; t < nthreads; t++) {
        void **arg = malloc(2 * sizeof(void *));
        if (arg) {
            arg[0] = m;
            arg[1] = &m->scratch[t];
        }
        if (!arg || pthread_create(&m->threads[t], NULL, worker, arg)) { /* fewer threads, not none */
            m->nthreads = t;
            free(arg);
            break;
        }
    }
    return m;
}
