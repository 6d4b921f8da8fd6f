/* A whole decode step as one call: the model's decode ops, listed once per engine (hybrid/decode_program.py
   builds the list: weights, cache pools and scratch buffers bound), run here back to back.

   Why: a fused decode step is ~60 native products and small ops; called one by one from Python, the ~5-20 us
   of interpreter, ctypes and tensor bookkeeping between them added up to as long as the products themselves,
   and each call woke the pool's sleeping workers anew. Here the step's per-step inputs (the rows' K/V slots,
   lengths, block tables, state slots, RoPE cos/sin) come in one HlStep; the workers spin between the ops of a
   program (pool_hot) and sleep after it. A step may also hand over its token ids and positions instead of its input
   rows and cos/sin: the program then gathers the embedding rows and the RoPE table rows itself (the engine's
   steady decode state, hybrid/decode_inputs.py: no tensor is made per step).

   The ops are the other files' functions, called directly (one declaration each in native.h / products.h). */

/* The op kinds (OP_GEMV, ...), HL_OP_PTRS / HL_OP_INTS / HL_OP_FLOATS and each op's field slots (P_GEMV_w, I_GEMV_N,
   F_PAGED_scale, ...) come from kernels/native/program_ops.py, which writes program_ops.h into the build directory
   (kernels/native/variants.py; never edited by hand); run_op reads an op's fields by name through them, as
   hybrid/decode/builder.py writes them by name from the same table. */
#include "native.h"
#include "products.h"
#include "program_ops.h"

struct HlOp {
    int64_t kind;
    const void *p[HL_OP_PTRS];
    int64_t i[HL_OP_INTS];
    double f[HL_OP_FLOATS];
};

struct HlStep {
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
};

/* a pointer slot holding this stands for the step's residual stream */
#define HL_STEP_X ((const void *)1)

static inline void *resolve(const void *p, const HlStep *st) { return p == HL_STEP_X ? st->x : (void *)p; }

static int run_op(const HlOp *o, const HlStep *st) {
    const int64_t n = st->n;
/* field `field` of op kind K: a pointer (resolved), an integer, a float */
#define PF(K, field) resolve(o->p[P_##K##_##field], st)
#define IF(K, field) (o->i[I_##K##_##field])
#define FF(K, field) (o->f[F_##K##_##field])
    switch (o->kind) {
    case OP_RMSNORM:
        hl_rmsnorm(PF(RMSNORM, x), (int)IF(RMSNORM, xdt), PF(RMSNORM, w), (int)IF(RMSNORM, wdt),
                   (float)FF(RMSNORM, eps), PF(RMSNORM, y), n, IF(RMSNORM, d));
        return 0;
    case OP_GEMV:
        return gemv_act(PF(GEMV, w), (int)IF(GEMV, wdt), PF(GEMV, scale), PF(GEMV, bias), (int)IF(GEMV, bdt),
                        PF(GEMV, x), (int)IF(GEMV, xdt), PF(GEMV, res), PF(GEMV, y), (int)IF(GEMV, ydt), n,
                        IF(GEMV, N), IF(GEMV, K), (int)IF(GEMV, act1));
    case OP_GATED_UP:
        return hl_gated_up(PF(GATED_UP, wg), PF(GATED_UP, sg), PF(GATED_UP, bg), PF(GATED_UP, wu), PF(GATED_UP, su),
                           PF(GATED_UP, bu), (int)IF(GATED_UP, wdt), (int)IF(GATED_UP, bdt), PF(GATED_UP, x),
                           (int)IF(GATED_UP, xdt), PF(GATED_UP, y), (int)IF(GATED_UP, act), n, IF(GATED_UP, N),
                           IF(GATED_UP, K));
    case OP_QKV_ROPE:
        return hl_qkv_rope(PF(QKV_ROPE, wq), PF(QKV_ROPE, bq), PF(QKV_ROPE, wk), PF(QKV_ROPE, bk), PF(QKV_ROPE, wv),
                           PF(QKV_ROPE, bv), PF(QKV_ROPE, sq), PF(QKV_ROPE, sk), PF(QKV_ROPE, sv),
                           (int)IF(QKV_ROPE, wdt), (int)IF(QKV_ROPE, bdt), PF(QKV_ROPE, x), (int)IF(QKV_ROPE, xdt),
                           PF(QKV_ROPE, q_out), PF(QKV_ROPE, kpool), PF(QKV_ROPE, vpool), (int)IF(QKV_ROPE, pdt),
                           st->kv_slots, st->cos, st->sin, IF(QKV_ROPE, rot), n, IF(QKV_ROPE, Hq),
                           IF(QKV_ROPE, Hkv), IF(QKV_ROPE, D), IF(QKV_ROPE, K));
    case OP_PAGED:
        return hl_paged_decode(PF(PAGED, q), (int)IF(PAGED, qdt), PF(PAGED, k), PF(PAGED, v), (int)IF(PAGED, kvdt),
                               st->seq_lens, st->tables, st->tstride, PF(PAGED, out), n, IF(PAGED, Hq),
                               IF(PAGED, Hkv), IF(PAGED, D), IF(PAGED, BS), IF(PAGED, window),
                               (float)FF(PAGED, scale));
    case OP_CONV:
        return hl_conv_step(PF(CONV, state), (int)IF(CONV, sdt), st->state_slots, PF(CONV, x), (int)IF(CONV, xdt),
                            IF(CONV, xs), PF(CONV, w), (int)IF(CONV, wdt), PF(CONV, bias), (int)IF(CONV, bdt),
                            (int)IF(CONV, silu), PF(CONV, y), n, IF(CONV, C), IF(CONV, K));
    case OP_DT:
        hl_mamba2_dt(PF(DT, dt_raw), (int)IF(DT, xdt), IF(DT, dts), PF(DT, dt_bias), (int)IF(DT, bdt), PF(DT, A_log),
                     (int)IF(DT, adt), (float)FF(DT, lo), (float)FF(DT, hi), (int)IF(DT, clamp), PF(DT, dt_out),
                     PF(DT, A_out), n, IF(DT, H));
        return 0;
    case OP_SSD:
        return hl_ssd_step(PF(SSD, state), (int)IF(SSD, sdt), st->state_slots, PF(SSD, x), (int)IF(SSD, xdt),
                           IF(SSD, xs), PF(SSD, dt), IF(SSD, dts), PF(SSD, A), PF(SSD, B), IF(SSD, bs), PF(SSD, C),
                           IF(SSD, cs), PF(SSD, Dp), (int)IF(SSD, ddt), PF(SSD, y), n, IF(SSD, H), IF(SSD, P),
                           IF(SSD, N), IF(SSD, G));
    case OP_GATED_RMSNORM:
        hl_gated_rmsnorm(PF(GATED_RMSNORM, y), PF(GATED_RMSNORM, z), IF(GATED_RMSNORM, zs),
                         (int)IF(GATED_RMSNORM, dt), PF(GATED_RMSNORM, w), (int)IF(GATED_RMSNORM, wdt),
                         (float)FF(GATED_RMSNORM, eps), IF(GATED_RMSNORM, groups),
                         (int)IF(GATED_RMSNORM, norm_before_gate), PF(GATED_RMSNORM, out), n, IF(GATED_RMSNORM, d));
        return 0;
    case OP_GEMV_INT4:
        return gemv_int4_act(PF(GEMV_INT4, q), PF(GEMV_INT4, sz), (int)IF(GEMV_INT4, sdt), IF(GEMV_INT4, G),
                             PF(GEMV_INT4, bias), (int)IF(GEMV_INT4, bdt), PF(GEMV_INT4, x), (int)IF(GEMV_INT4, xdt),
                             PF(GEMV_INT4, res), PF(GEMV_INT4, y), (int)IF(GEMV_INT4, ydt), n, IF(GEMV_INT4, N),
                             IF(GEMV_INT4, K), (int)IF(GEMV_INT4, act1), (int)IF(GEMV_INT4, bn));
    case OP_GATED_UP_INT4:
        return hl_gated_up_int4(PF(GATED_UP_INT4, qg), PF(GATED_UP_INT4, szg), PF(GATED_UP_INT4, bg),
                                PF(GATED_UP_INT4, qu), PF(GATED_UP_INT4, szu), PF(GATED_UP_INT4, bu),
                                (int)IF(GATED_UP_INT4, sdt), IF(GATED_UP_INT4, G), (int)IF(GATED_UP_INT4, bdt),
                                PF(GATED_UP_INT4, x), (int)IF(GATED_UP_INT4, xdt), PF(GATED_UP_INT4, y),
                                (int)IF(GATED_UP_INT4, act), n, IF(GATED_UP_INT4, N), IF(GATED_UP_INT4, K),
                                (int)IF(GATED_UP_INT4, bn));
    case OP_QKV_ROPE_INT4:
        return hl_qkv_rope_int4(PF(QKV_ROPE_INT4, qq), PF(QKV_ROPE_INT4, szq), PF(QKV_ROPE_INT4, bq),
                                PF(QKV_ROPE_INT4, qk), PF(QKV_ROPE_INT4, szk), PF(QKV_ROPE_INT4, bk),
                                PF(QKV_ROPE_INT4, qv), PF(QKV_ROPE_INT4, szv), PF(QKV_ROPE_INT4, bv),
                                (int)IF(QKV_ROPE_INT4, sdt), IF(QKV_ROPE_INT4, G), (int)IF(QKV_ROPE_INT4, bdt),
                                PF(QKV_ROPE_INT4, x), (int)IF(QKV_ROPE_INT4, xdt), PF(QKV_ROPE_INT4, q_out),
                                PF(QKV_ROPE_INT4, kpool), PF(QKV_ROPE_INT4, vpool), (int)IF(QKV_ROPE_INT4, pdt),
                                st->kv_slots, st->cos, st->sin, IF(QKV_ROPE_INT4, rot), n, IF(QKV_ROPE_INT4, Hq),
                                IF(QKV_ROPE_INT4, Hkv), IF(QKV_ROPE_INT4, D), IF(QKV_ROPE_INT4, K),
                                (int)IF(QKV_ROPE_INT4, bn));
    case OP_GEMV_Q:
        return gemv_q_act((int)IF(GEMV_Q, qkind), PF(GEMV_Q, w), PF(GEMV_Q, ws), PF(GEMV_Q, bias),
                          (int)IF(GEMV_Q, bdt), PF(GEMV_Q, x), (int)IF(GEMV_Q, xdt), PF(GEMV_Q, res), PF(GEMV_Q, y),
                          (int)IF(GEMV_Q, ydt), n, IF(GEMV_Q, N), IF(GEMV_Q, K), (int)IF(GEMV_Q, act1));
    case OP_QKV_ROPE_Q:
        return hl_qkv_rope_q((int)IF(QKV_ROPE_Q, qkind), PF(QKV_ROPE_Q, wq), PF(QKV_ROPE_Q, sq), PF(QKV_ROPE_Q, bq),
                             PF(QKV_ROPE_Q, wk), PF(QKV_ROPE_Q, sk), PF(QKV_ROPE_Q, bk), PF(QKV_ROPE_Q, wv),
                             PF(QKV_ROPE_Q, sv), PF(QKV_ROPE_Q, bv), (int)IF(QKV_ROPE_Q, bdt), PF(QKV_ROPE_Q, x),
                             (int)IF(QKV_ROPE_Q, xdt), PF(QKV_ROPE_Q, q_out), PF(QKV_ROPE_Q, kpool),
                             PF(QKV_ROPE_Q, vpool), (int)IF(QKV_ROPE_Q, pdt), st->kv_slots, st->cos, st->sin,
                             IF(QKV_ROPE_Q, rot), n, IF(QKV_ROPE_Q, Hq), IF(QKV_ROPE_Q, Hkv), IF(QKV_ROPE_Q, D),
                             IF(QKV_ROPE_Q, K));
    case OP_GATED_UP_Q:
        return hl_gated_up_q((int)IF(GATED_UP_Q, qkind), PF(GATED_UP_Q, wg), PF(GATED_UP_Q, sg), PF(GATED_UP_Q, bg),
                             PF(GATED_UP_Q, wu), PF(GATED_UP_Q, su), PF(GATED_UP_Q, bu), (int)IF(GATED_UP_Q, bdt),
                             PF(GATED_UP_Q, x), (int)IF(GATED_UP_Q, xdt), PF(GATED_UP_Q, y), (int)IF(GATED_UP_Q, act),
                             n, IF(GATED_UP_Q, N), IF(GATED_UP_Q, K));
    case OP_GDN:
        return hl_gdn_decode(PF(GDN, state), (int)IF(GDN, sdt), st->state_slots, PF(GDN, qkv), (int)IF(GDN, xdt),
                             IF(GDN, qkv_s), PF(GDN, ba), IF(GDN, ba_s), PF(GDN, A_log), (int)IF(GDN, adt),
                             PF(GDN, dt_bias), (int)IF(GDN, bdt), PF(GDN, qk), PF(GDN, g), PF(GDN, beta), PF(GDN, y),
                             n, IF(GDN, H), IF(GDN, Hk), IF(GDN, K), IF(GDN, V), (float)FF(GDN, eps),
                             (float)FF(GDN, scale));
    case OP_HEAD_NORM:
        hl_head_rmsnorm(PF(HEAD_NORM, y), IF(HEAD_NORM, ys), PF(HEAD_NORM, z), IF(HEAD_NORM, zs),
                        (int)IF(HEAD_NORM, dt), PF(HEAD_NORM, w), (int)IF(HEAD_NORM, wdt), (float)FF(HEAD_NORM, eps),
                        (int)IF(HEAD_NORM, gated), PF(HEAD_NORM, out), n, IF(HEAD_NORM, H), IF(HEAD_NORM, V));
        return 0;
    case OP_GLA:
        return hl_gla_decode(PF(GLA, state), (int)IF(GLA, sdt), st->state_slots, PF(GLA, qkv), (int)IF(GLA, xdt),
                             IF(GLA, qkv_s), PF(GLA, low), IF(GLA, low_s), PF(GLA, low_buf), PF(GLA, w),
                             PF(GLA, wscale), (int)IF(GLA, wdt), PF(GLA, bias), (int)IF(GLA, bdt), PF(GLA, gk),
                             PF(GLA, g), PF(GLA, y), n, IF(GLA, R), IF(GLA, H), IF(GLA, Hkv), IF(GLA, K), IF(GLA, V),
                             (float)FF(GLA, normalizer), (float)FF(GLA, clamp_min), (int)IF(GLA, clamp));
    default:
        return -1;
    }
#undef PF
#undef IF
#undef FF
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
    return running - 1 > cpus - pool_threads();
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
    pool_hot(!P_solo);
    int64_t rc = 0;
    for (int64_t k = 0; k < nops; ++k) {
        const double t0 = times ? now_us() : 0.0;
        if (run_op(&ops[k], st) != 0) {
            rc = -(k + 1);
            break;
        }
        if (times) times[k] += now_us() - t0;
    }
    pool_hot(0);
    if (!P_solo && P_waited_us > SOLO_WAIT * (now_us() - t_run) && oversubscribed() != 0)
        P_solo_left = st->n > SOLO_FEW_ROWS ? SOLO_STEPS_WIDE : SOLO_STEPS;
    P_solo = 0;
    return rc;
}


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
