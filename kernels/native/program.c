/* A whole decode step as one call: the model's decode ops, listed once per engine (hybrid/decode_program.py
   builds the list: weights, cache pools and scratch buffers bound), run here back to back.

   Why: a fused decode step is ~60 native products and small ops; called one by one from Python, the ~5-20 us
   of interpreter, ctypes and tensor bookkeeping between them added up to as long as the products themselves,
   and each call woke the pool's sleeping workers anew. Here the step's per-step inputs (the rows' K/V slots,
   lengths, block tables, state slots, RoPE cos/sin) come in one HlStep; the workers spin between the ops of a
   program (P.hot) and sleep after it. A step may also hand over its token ids and positions instead of its input
   rows and cos/sin: the program then gathers the embedding rows and the RoPE table rows itself (the engine's
   steady decode state, hybrid/decode_inputs.py: no tensor is made per step).

   Compiled together with decode.c (one translation unit: the ops are its static functions). */

enum {
    OP_RMSNORM = 0,
    OP_GEMV = 1,
    OP_GATED_UP = 2,
    OP_QKV_ROPE = 3,
    OP_PAGED = 4,
    OP_CONV = 5,
    OP_DT = 6,
    OP_SSD = 7,
    OP_GATED_RMSNORM = 8,
    OP_GEMV_INT4 = 9,
    OP_GATED_UP_INT4 = 10,
    OP_QKV_ROPE_INT4 = 11,
    /* int8 activations (int8dq / 8da4w weights, decode.c's int8-activation products); 15 is free */
    OP_GEMV_Q = 12,
    OP_QKV_ROPE_Q = 13,
    OP_GATED_UP_Q = 14,
    /* linear-attention mixers (linear_attention.c) */
    OP_GDN = 16,
    OP_HEAD_NORM = 17,
    OP_GLA = 18,
};

#define HL_OP_PTRS 14
#define HL_OP_INTS 14

typedef struct {
    int64_t kind;
    const void *p[HL_OP_PTRS];
    int64_t i[HL_OP_INTS];
    double f[2];
} HlOp;

typedef struct {
    int64_t n;                 /* rows (one token each) */
    void *x;                   /* [n, d_model] the residual stream, updated in place */
    const int64_t *kv_slots;   /* [n] each row's K/V pool slot */
    const int32_t *seq_lens;   /* [n] K/V length after this token */
    const int32_t *tables;     /* [n, tstride] block tables */
    int64_t tstride;
    const int64_t *state_slots; /* [n] constant-state slots */
    void *cos, *sin;           /* [n, rot] in the model dtype */
    /* optional gathers done before the first op (NULL: the caller did them) */
    const int64_t *tokens;     /* [n] token ids: x[r] = embed[tokens[r]] */
    const void *embed;         /* [vocab, d_model] the embedding matrix, rows of embed_row_bytes */
    int64_t embed_row_bytes, vocab;
    const int64_t *positions;  /* [n] positions: cos[r] = cos_table[positions[r]], same for sin */
    const void *cos_table, *sin_table; /* [table_rows, rot], rows of rope_row_bytes */
    int64_t rope_row_bytes, table_rows;
} HlStep;

/* a pointer slot holding this stands for the step's residual stream */
#define HL_STEP_X ((const void *)1)

static inline void *resolve(const void *p, const HlStep *st) { return p == HL_STEP_X ? st->x : (void *)p; }

static int run_op(const HlOp *o, const HlStep *st) {
    const int64_t n = st->n;
#define P(k) resolve(o->p[k], st)
#define I(k) (o->i[k])
    switch (o->kind) {
    case OP_RMSNORM:
        hl_rmsnorm(P(0), (int)I(0), P(1), (int)I(1), (float)o->f[0], P(2), n, I(2));
        return 0;
    case OP_GEMV:
        return gemv_act(P(0), (int)I(0), P(1), P(2), (int)I(1), P(3), (int)I(2), P(4), P(5), (int)I(3), n, I(4),
                        I(5), (int)I(6));
    case OP_GATED_UP:
        return hl_gated_up(P(0), P(1), P(2), P(3), P(4), P(5), (int)I(0), (int)I(1), P(6), (int)I(2), P(7),
                           (int)I(3), n, I(4), I(5));
    case OP_QKV_ROPE:
        return hl_qkv_rope(P(0), P(1), P(2), P(3), P(4), P(5), P(6), P(7), P(8), (int)I(0), (int)I(1), P(9),
                           (int)I(2), P(10), P(11), P(12), (int)I(3), st->kv_slots, st->cos, st->sin, I(4), n,
                           I(5), I(6), I(7), I(8));
    case OP_PAGED:
        return hl_paged_decode(P(0), (int)I(0), P(1), P(2), (int)I(1), st->seq_lens, st->tables, st->tstride,
                               P(3), n, I(2), I(3), I(4), I(5), I(6), (float)o->f[0]);
    case OP_CONV:
        return hl_conv_step(P(0), (int)I(0), st->state_slots, P(1), (int)I(1), I(2), P(2), (int)I(3), P(3),
                            (int)I(4), (int)I(5), P(4), n, I(6), I(7));
    case OP_DT:
        hl_mamba2_dt(P(0), (int)I(0), I(1), P(1), (int)I(2), P(2), (int)I(3), (float)o->f[0], (float)o->f[1],
                     (int)I(4), P(3), P(4), n, I(5));
        return 0;
    case OP_SSD:
        return hl_ssd_step(P(0), (int)I(0), st->state_slots, P(1), (int)I(1), I(2), P(2), I(3), P(3), P(4), I(4),
                           P(5), I(5), P(6), (int)I(6), P(7), n, I(7), I(8), I(9), I(10));
    case OP_GATED_RMSNORM:
        hl_gated_rmsnorm(P(0), P(1), I(0), (int)I(1), P(2), (int)I(2), (float)o->f[0], I(3), (int)I(4), P(3), n,
                         I(5));
        return 0;
    case OP_GEMV_INT4:
        return gemv_int4_act(P(0), P(1), (int)I(0), I(1), P(2), (int)I(2), P(3), (int)I(3), P(4), P(5), (int)I(4), n,
                             I(5), I(6), (int)I(7), (int)I(8));
    case OP_GATED_UP_INT4:
        return hl_gated_up_int4(P(0), P(1), P(2), P(3), P(4), P(5), (int)I(0), I(1), (int)I(2), P(6), (int)I(3), P(7),
                                (int)I(4), n, I(5), I(6), (int)I(7));
    case OP_QKV_ROPE_INT4:
        return hl_qkv_rope_int4(P(0), P(1), P(2), P(3), P(4), P(5), P(6), P(7), P(8), (int)I(0), I(1), (int)I(2),
                                P(9), (int)I(3), P(10), P(11), P(12), (int)I(4), st->kv_slots, st->cos, st->sin,
                                I(5), n, I(6), I(7), I(8), I(9), (int)I(10));
    case OP_GEMV_Q:
        return gemv_q_act((int)I(0), P(0), P(1), P(2), (int)I(1), P(3), (int)I(2), P(4), P(5), (int)I(3), n, I(4),
                          I(5), (int)I(6));
    case OP_QKV_ROPE_Q:
        return hl_qkv_rope_q((int)I(0), P(0), P(1), P(2), P(3), P(4), P(5), P(6), P(7), P(8), (int)I(1), P(9),
                             (int)I(2), P(10), P(11), P(12), (int)I(3), st->kv_slots, st->cos, st->sin, I(4), n, I(5),
                             I(6), I(7), I(8));
    case OP_GATED_UP_Q:
        return hl_gated_up_q((int)I(0), P(0), P(1), P(2), P(3), P(4), P(5), (int)I(1), P(6), (int)I(2), P(7),
                             (int)I(3), n, I(4), I(5));
    case OP_GDN:
        return hl_gdn_decode(P(0), (int)I(0), st->state_slots, P(1), (int)I(1), I(2), P(2), I(3), P(3), (int)I(4),
                             P(4), (int)I(5), P(5), P(6), P(7), P(8), n, I(6), I(7), I(8), I(9), (float)o->f[0],
                             (float)o->f[1]);
    case OP_HEAD_NORM:
        hl_head_rmsnorm(P(0), I(0), P(1), I(1), (int)I(2), P(2), (int)I(3), (float)o->f[0], (int)I(4), P(3), n, I(5),
                        I(6));
        return 0;
    case OP_GLA:
        return hl_gla_decode(P(0), (int)I(0), st->state_slots, P(1), (int)I(1), I(2), P(2), I(3), P(3), P(4), P(5),
                             (int)I(4), P(6), (int)I(5), P(7), P(8), P(9), n, I(6), I(7), I(8), I(9), I(10),
                             (float)o->f[0], (float)o->f[1], (int)I(11));
    default:
        return -1;
    }
#undef P
#undef I
}

/* the step's gathers (see HlStep); 0, or -1 for a token id or position outside its table (nothing run) */
static int gather_inputs(const HlStep *st) {
    for (int64_t r = 0; r < st->n; ++r) {
        if (st->tokens && (st->tokens[r] < 0 || st->tokens[r] >= st->vocab)) return -1;
        if (st->positions && (st->positions[r] < 0 || st->positions[r] >= st->table_rows)) return -1;
    }
    for (int64_t r = 0; st->tokens && r < st->n; ++r)
        memcpy((char *)st->x + r * st->embed_row_bytes,
               (const char *)st->embed + st->tokens[r] * st->embed_row_bytes, (size_t)st->embed_row_bytes);
    for (int64_t r = 0; st->positions && r < st->n; ++r) {
        const int64_t at = st->positions[r] * st->rope_row_bytes, to = r * st->rope_row_bytes;
        memcpy((char *)st->cos + to, (const char *)st->cos_table + at, (size_t)st->rope_row_bytes);
        memcpy((char *)st->sin + to, (const char *)st->sin_table + at, (size_t)st->rope_row_bytes);
    }
    return 0;
}

/* Contention: when another process keeps a worker off its core, a step waits at the end of each op for the chunk
   that worker claimed (up to a scheduler time slice, milliseconds), and a contended step's time swings between its
   quiet time and several times it. A program that waited SOLO_WAIT of its time on workers sends the next SOLO_STEPS
   programs to the caller alone (the workers sleep), then the workers are tried again. On the 2-vCPU Zen 4 beside a
   busy process (benchmarks.contention, two runs) the contended median over the min went from 1.98 / 1.65 / 2.06 to
   1.08-1.13 / 1.32 / 1.21-1.22 (llama / mamba2 / 7:1 hybrid d512), and the contended medians from 9.4 / 7.9 / 15.8
   ms to 7.2-8.0 / 5.9-7.3 / 8.8-9.0. A host that stalls a worker for a moment triggers it too (3-53 of 200 quiet
   steps ran alone here, at no visible cost to the quiet medians); requiring two stalls in a row, or spans that
   start at 8 and double, kept the quiet runs on two threads but lost the contended goal (1.36-2.2).
   A step of more than SOLO_FEW_ROWS rows sends only the next SOLO_STEPS_WIDE: such a batch is compute-bound, so a
   program alone takes twice as long, and 32 of them after one false trigger (a stall of the host's, e.g. just after
   another process freed 7 GB) cost ~1.4 s at 32 rows: llama-small's 32-request loop (benchmarks.vllm_cpu.
   ours_same_way) read 502-505 tok/s after such a process (47 and 81 programs alone), 650-667 with the fallback off;
   32 against 4 programs, alternating on a noisy host: 439-599 (32-102 alone) against 523-669 (8-12 alone). A span
   capped at 300 ms instead, whatever the batch, read 632-677 there but cut batch-1 spans short under real
   contention (benchmarks.contention's goal failed in 2 of 3 runs, the 32-program span's in 0 of 3, alternating). */
#define SOLO_WAIT 0.25
#define SOLO_STEPS 32
/* A trigger counts only where the machine is oversubscribed (oversubscribed() below): a host that stalls a vCPU
   (this VM's steal, seconds-long phases of it) looks like contention from inside, but with no other runnable thread
   in the guest two threads stay the better bet. Before this check, one such stall in a 64-token batch-1 run sent
   32 of its programs to one thread: benchmarks.decode's bf16 llama-d512 rounds read 292-309 tok/s against 409-437
   in the rounds it missed (the same run, llama.cpp 458-491 throughout). */
#define SOLO_FEW_ROWS 8
#define SOLO_STEPS_WIDE 4
static int64_t P_solo_left = 0, P_solo_runs = 0;

/* 1 when the guest's other runnable threads (/proc/loadavg's running count, less the caller) leave fewer free CPUs
   than the pool's workers need; 0 when they do not; -1 where it cannot tell (no /proc: then a trigger counts). A
   worker spinning at that moment counts as another thread (the old behaviour: go alone); a CPU-bound process beside
   us is runnable whenever it is read. */
static int oversubscribed(void) {
    const int fd = open("/proc/loadavg", O_RDONLY);
    if (fd < 0) return -1;
    char buf[128];
    const ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return -1;
    buf[n] = 0;
    const char *p = buf; /* "0.52 0.58 0.59 3/122 10061": the fourth field's first number */
    for (int f = 0; f < 3 && p; ++f)
        if ((p = strchr(p, ' '))) ++p;
    const long running = p ? strtol(p, NULL, 10) : 0, cpus = sysconf(_SC_NPROCESSORS_ONLN);
    if (running < 1 || cpus < 1) return -1;
    return running - 1 > cpus - 1 - P.nworkers;
}

/* how many programs ran on the caller alone since the library loaded (kernels.native.solo_runs) */
int64_t hl_program_solo_runs(void) { return P_solo_runs; }

/* Runs ops[0..nops) on one step. Returns 0, or -(k + 1) when op k refused its arguments (nothing after it
   ran). times (or NULL): each op's wall time in microseconds is added to times[k]. */
int64_t hl_program_run(const HlOp *ops, int64_t nops, const HlStep *st, double *times) {
    if (st->n < 1 || st->n > MAXB || gather_inputs(st)) return -(nops + 1);
    P_solo = P_solo_left > 0;
    if (P_solo) --P_solo_left, ++P_solo_runs;
    P_waited_us = 0.0;
    const double t_run = now_us();
    atomic_store_explicit(&P.hot, !P_solo, memory_order_relaxed);
    int64_t rc = 0;
    for (int64_t k = 0; k < nops; ++k) {
        const double t0 = times ? now_us() : 0.0;
        if (run_op(&ops[k], st) != 0) {
            rc = -(k + 1);
            break;
        }
        if (times) times[k] += now_us() - t0;
    }
    atomic_store_explicit(&P.hot, 0, memory_order_relaxed);
    if (!P_solo && P_waited_us > SOLO_WAIT * (now_us() - t_run) && oversubscribed() != 0)
        P_solo_left = st->n > SOLO_FEW_ROWS ? SOLO_STEPS_WIDE : SOLO_STEPS;
    P_solo = 0;
    return rc;
}

void hl_argmax(const void *x, int dt, int64_t rows, int64_t V, int64_t *out);

/* Several greedy decode steps in one call (the engine's multi-step decode: hybrid/engine.py): step s runs the
   program on the rows' current tokens, takes each row's argmax of the logits (logits [n, V] of dtype ldt, the
   program's LM-head output) into ids[s * n + r], and makes it the row's next token: its position and KV length
   one more, its K/V slot the next one along its block table (blocks of block_size; 0: no attention, slot 0).
   The step's token, position, K/V slot and length arrays are the caller's and are left as the last step had them;
   the caller has grown every row's blocks to hold its tokens of all the steps and the RoPE table to its last
   position. Returns 0, or what hl_program_run returned for the step that failed (no later step ran). */
int64_t hl_program_steps(const HlOp *ops, int64_t nops, HlStep *st, double *times, int64_t steps, int64_t block_size,
                         const void *logits, int ldt, int64_t V, int64_t *ids) {
    int64_t *tokens = (int64_t *)st->tokens, *positions = (int64_t *)st->positions;
    int64_t *slots = (int64_t *)st->kv_slots;
    int32_t *lens = (int32_t *)st->seq_lens;
    if (!tokens || steps < 1) return -(nops + 1);
    for (int64_t s = 0; s < steps; ++s) {
        if (s > 0)
            for (int64_t r = 0; r < st->n; ++r) {
                tokens[r] = ids[(s - 1) * st->n + r];
                if (positions) positions[r] += 1;
                const int64_t q = lens[r]; /* the new token's index in the row's blocks */
                lens[r] += 1;
                slots[r] = block_size ? (int64_t)st->tables[r * st->tstride + q / block_size] * block_size +
                                            q % block_size
                                      : 0;
            }
        const int64_t rc = hl_program_run(ops, nops, st, times);
        if (rc) return rc;
        hl_argmax(logits, ldt, st->n, V, ids + s * st->n);
    }
    return 0;
}

/* sizeof(HlOp), sizeof(HlStep): the Python side checks its ctypes mirror against them */
int64_t hl_program_abi(void) { return (int64_t)sizeof(HlOp) * 1000 + (int64_t)sizeof(HlStep); }

/* Greedy sampling's argmax over rows of logits [rows, V] (fp32 or bf16): the first index of the largest value,
   NaN counted largest as torch.argmax counts it. Torch's took 74 us for one 32000-wide row on one thread, 1% of
   a decode step. */
static inline int is_nan_bits(float v) { /* not v != v: -ffast-math assumes no NaNs and drops that test */
    uint32_t b;
    memcpy(&b, &v, 4);
    return (b & 0x7fffffffu) > 0x7f800000u;
}

#ifdef __AVX2__
/* eight fp32 or bf16 values from x[i..i+8) as fp32 (bf16 widened exactly: its bits are the fp32's top half) */
static inline __m256 argmax_load8(const void *x, int dt, int64_t i) {
    if (dt == DT_F32) return _mm256_loadu_ps((const float *)x + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

void hl_argmax(const void *x, int dt, int64_t rows, int64_t V, int64_t *out) {
#ifdef __AVX2__
    if (dt == DT_F32 || dt == DT_BF16) { /* two vector passes: the largest value (and any NaN), then its first index */
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t row = r * V;
            const void *p = dt == DT_F32 ? (const void *)((const float *)x + row)
                                         : (const void *)((const uint16_t *)x + row);
            __m256 mx = _mm256_set1_ps(-FLT_MAX), nan = _mm256_setzero_ps();
            int64_t i = 0;
            for (; i + 8 <= V; i += 8) {
                const __m256 v = argmax_load8(p, dt, i);
                mx = _mm256_max_ps(mx, v);
                nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            }
            float m = -FLT_MAX, lanes[8];
            int has_nan = _mm256_movemask_ps(nan) != 0;
            _mm256_storeu_ps(lanes, mx);
            for (int l = 0; l < 8; ++l) m = lanes[l] > m ? lanes[l] : m;
            for (; i < V; ++i) {
                const float v = load_as_f32(x, dt, row + i);
                has_nan |= is_nan_bits(v);
                m = v > m ? v : m;
            }
            int64_t best = 0;
            i = 0;
            if (!has_nan) {
                const __m256 mv = _mm256_set1_ps(m);
                for (; i + 8 <= V; i += 8)
                    if (_mm256_movemask_ps(_mm256_cmp_ps(argmax_load8(p, dt, i), mv, _CMP_EQ_OQ))) break;
            }
            for (; i < V; ++i) {
                const float v = load_as_f32(x, dt, row + i);
                if (has_nan ? is_nan_bits(v) : v == m) break;
            }
            best = i < V ? i : 0;
            out[r] = best;
        }
        return;
    }
#endif
    for (int64_t r = 0; r < rows; ++r) {
        int64_t best = 0;
        float bv = load_as_f32(x, dt, r * V);
        for (int64_t i = 1; i < V && !is_nan_bits(bv); ++i) {
            const float v = load_as_f32(x, dt, r * V + i);
            if (v > bv || is_nan_bits(v)) best = i, bv = v;
        }
        out[r] = best;
    }
}
