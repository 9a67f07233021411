/* TANGO's gate average on CPUs: the three products of causal probabilities with wide gates,
   computed over exactly the causal triangle (BLAS has no such GEMM; PyTorch's blocked path
   computes 5/8 of the square at T = 256). Built at first use by `cpu_kernels.py` with the
   machine's own vector width (-march=native) and called through ctypes. Each call runs its
   (batch element, head, column block) tasks on OpenMP threads: built with -fopenmp against the
   libgomp that PyTorch has loaded, these are PyTorch's own threads (a second pool would compete
   with them while they spin after each op); without OpenMP the caller splits the (batch element,
   head) items over threads.

   Layouts (all float32, contiguous): probabilities P [B, H, T, T] with exact zeros above the
   diagonal; gates, u, averages and their gradients [B, T, H * W], head h in columns h*W..h*W+W-1.
   Any W: the last W % VL columns of a head go through the partial-vector tails below. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#define VL 16 /* floats per vector */
#define CV 4  /* vectors per column tile: 6 x 4 accumulators of 32 registers */
#elif defined(__AVX__)
#define VL 8
#define CV 2 /* 6 x 2 accumulators of 16 registers */
#else
#define VL 4
#define CV 4 /* 128-bit vectors: NEON (32 registers), and SSE builds too (16, so some accumulators spill) */
#endif
#define R 6 /* rows per tile */
#define NB (VL * CV)

typedef float vec __attribute__((vector_size(4 * VL)));
typedef int64_t i64;

static inline vec load(const float *p) { vec v; memcpy(&v, p, sizeof v); return v; }
static inline void store(float *p, vec v) { memcpy(p, &v, sizeof v); }
/* The first n < VL floats, zero-padded; and their store. */
static inline vec load_part(const float *p, int n) { vec v = {0}; memcpy(&v, p, n * sizeof(float)); return v; }
static inline void store_part(float *p, vec v, int n) { memcpy(p, &v, n * sizeof(float)); }
static inline i64 min64(i64 a, i64 b) { return a < b ? a : b; }

/* Rows t0 .. t0+rows-1 of tril(P) @ G for nv vectors of columns from c0:
   acc[r] = sum over s < t0+rows of P[t0+r, s] G[s, c0:...] (P is zero beyond each row's diagonal).
   Unless Y is NULL, y = acc * u is stored too. nv is a constant at each call site, so the loops unroll. */
static inline __attribute__((always_inline)) void avg_tile(int nv, i64 t0, i64 rows, i64 c0, const float *P, i64 T,
                                                          const float *G, i64 ld, const float *U, float *AVG, float *Y) {
    vec acc[R][CV];
    const float *prow[R];
    for (int r = 0; r < R; r++) {
        prow[r] = P + (t0 + (r < rows ? r : rows - 1)) * T;
        for (int j = 0; j < nv; j++) acc[r][j] = (vec){0};
    }
    for (i64 s = 0; s < t0 + rows; s++) {
        const float *g = G + s * ld + c0;
        vec gv[CV];
        for (int j = 0; j < nv; j++) gv[j] = load(g + VL * j);
        for (int r = 0; r < R; r++) {
            float p = prow[r][s];
            for (int j = 0; j < nv; j++) acc[r][j] += p * gv[j];
        }
    }
    for (int r = 0; r < rows; r++) {
        i64 off = (t0 + r) * ld + c0;
        for (int j = 0; j < nv; j++) {
            store(AVG + off + VL * j, acc[r][j]);
            if (Y) store(Y + off + VL * j, acc[r][j] * load(U + off + VL * j));
        }
    }
}

/* Rows s0 .. s0+rows-1 of tril(P)^T @ D: acc[r] = sum over t >= s0 of P[t, s0+r] D[t, c0:...]. */
static inline __attribute__((always_inline)) void grad_gates_tile(int nv, i64 s0, i64 rows, i64 c0, const float *P,
                                                                 i64 T, const float *D, i64 ld, float *OUT) {
    vec acc[R][CV];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < nv; j++) acc[r][j] = (vec){0};
    for (i64 t = s0; t < T; t++) {
        const float *d = D + t * ld + c0;
        const float *p = P + t * T + s0;
        vec dv[CV];
        for (int j = 0; j < nv; j++) dv[j] = load(d + VL * j);
        for (int r = 0; r < R; r++) {
            float pr = r < rows ? p[r] : 0.0f;
            for (int j = 0; j < nv; j++) acc[r][j] += pr * dv[j];
        }
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < nv; j++) store(OUT + (s0 + r) * ld + c0 + VL * j, acc[r][j]);
}

/* Rows t0 .. t0+rows-1 of D @ G^T for nv vectors of sources, G^T packed as pack[k * NB + j]. */
static inline __attribute__((always_inline)) void grad_probs_tile(int nv, i64 t0, i64 rows, i64 W, const float *D,
                                                                 i64 ld, const float *pack, vec acc[R][CV]) {
    const float *drow[R];
    for (int r = 0; r < R; r++) {
        drow[r] = D + (t0 + (r < rows ? r : rows - 1)) * ld;
        for (int j = 0; j < nv; j++) acc[r][j] = (vec){0};
    }
    for (i64 k = 0; k < W; k++) {
        const float *p = pack + k * NB;
        vec gv[CV];
        for (int j = 0; j < nv; j++) gv[j] = load(p + VL * j);
        for (int r = 0; r < R; r++) {
            float dk = drow[r][k];
            for (int j = 0; j < nv; j++) acc[r][j] += dk * gv[j];
        }
    }
}

/* The last n < VL columns from c0 of avg_tile and grad_gates_tile (a head's W % VL columns). */
static void avg_tail(int n, i64 t0, i64 rows, i64 c0, const float *P, i64 T, const float *G, i64 ld, const float *U,
                     float *AVG, float *Y) {
    vec acc[R];
    const float *prow[R];
    for (int r = 0; r < R; r++) {
        prow[r] = P + (t0 + (r < rows ? r : rows - 1)) * T;
        acc[r] = (vec){0};
    }
    for (i64 s = 0; s < t0 + rows; s++) {
        vec gv = load_part(G + s * ld + c0, n);
        for (int r = 0; r < R; r++) acc[r] += prow[r][s] * gv;
    }
    for (int r = 0; r < rows; r++) {
        i64 off = (t0 + r) * ld + c0;
        store_part(AVG + off, acc[r], n);
        if (Y) store_part(Y + off, acc[r] * load_part(U + off, n), n);
    }
}

static void grad_gates_tail(int n, i64 s0, i64 rows, i64 c0, const float *P, i64 T, const float *D, i64 ld,
                            float *OUT) {
    vec acc[R];
    for (int r = 0; r < R; r++) acc[r] = (vec){0};
    for (i64 t = s0; t < T; t++) {
        vec dv = load_part(D + t * ld + c0, n);
        const float *p = P + t * T + s0;
        for (int r = 0; r < rows; r++) acc[r] += p[r] * dv;
    }
    for (int r = 0; r < rows; r++) store_part(OUT + (s0 + r) * ld + c0, acc[r], n);
}

/* Calls call(n) with a constant n = nv (1 <= nv <= CV), so that each width gets its own unrolled code. */
#if CV == 4
#define BY_WIDTH(nv, call)                                                                                            \
    switch (nv) {                                                                                                      \
    case 1: call(1); break;                                                                                            \
    case 2: call(2); break;                                                                                            \
    case 3: call(3); break;                                                                                            \
    default: call(4); break;                                                                                           \
    }
#else
#define BY_WIDTH(nv, call)                                                                                            \
    if ((nv) == 1) {                                                                                                   \
        call(1);                                                                                                       \
    } else {                                                                                                           \
        call(CV);                                                                                                      \
    }
#endif

/* The work of each call is split into (item, column block) tasks, item = b * H + h, so that
   even one sequence with few heads keeps every thread busy. A column block is NB columns of one
   head; the last one also takes the head's W % VL columns that fill no whole vector. */

/* Columns c0 .. c0+NB-1 (up to W) of one head's average, and of y = avg * u unless y is NULL. */
static void average_columns(i64 T, i64 W, i64 ld, i64 c0, const float *p, const float *g, const float *u, float *avg,
                            float *y) {
    i64 full = W - W % VL, c1 = min64(c0 + NB, W), vend = min64(c1, full);
    int nv = vend > c0 ? (int)((vend - c0) / VL) : 0;
    for (i64 t0 = 0; nv && t0 < T; t0 += R) {
        i64 rows = min64(R, T - t0);
#define AVG_TILE(n) avg_tile(n, t0, rows, c0, p, T, g, ld, u, avg, y)
        BY_WIDTH(nv, AVG_TILE)
#undef AVG_TILE
    }
    if (c1 > full)
        for (i64 t0 = 0; t0 < T; t0 += R) avg_tail((int)(W - full), t0, min64(R, T - t0), full, p, T, g, ld, u, avg, y);
}

/* Columns c0 .. c0+NB-1 (up to W) of one head's gate gradient tril(P)^T @ D. */
static void grad_gates_columns(i64 T, i64 W, i64 ld, i64 c0, const float *p, const float *d, float *out) {
    i64 full = W - W % VL, c1 = min64(c0 + NB, W), vend = min64(c1, full);
    int nv = vend > c0 ? (int)((vend - c0) / VL) : 0;
    for (i64 s0 = 0; nv && s0 < T; s0 += R) {
        i64 rows = min64(R, T - s0);
#define GRAD_TILE(n) grad_gates_tile(n, s0, rows, c0, p, T, d, ld, out)
        BY_WIDTH(nv, GRAD_TILE)
#undef GRAD_TILE
    }
    if (c1 > full)
        for (i64 s0 = 0; s0 < T; s0 += R) grad_gates_tail((int)(W - full), s0, min64(R, T - s0), full, p, T, d, ld, out);
}

/* avg = tril(P) @ G per head, and y = avg * u unless Y is NULL, for items i0 .. i1-1. */
void tango_average(i64 H, i64 T, i64 W, const float *P, const float *G, const float *U, float *AVG, float *Y, i64 i0,
                   i64 i1, int n_threads) {
    i64 ld = H * W, n_col = (W + NB - 1) / NB;
#pragma omp parallel for collapse(2) schedule(static) num_threads(n_threads)
    for (i64 item = i0; item < i1; item++) {
        for (i64 ci = 0; ci < n_col; ci++) {
            i64 base = (item / H) * T * ld + (item % H) * W;
            average_columns(T, W, ld, ci * NB, P + item * T * T, G + base, Y ? U + base : NULL, AVG + base,
                            Y ? Y + base : NULL);
        }
    }
}

/* grad_g = tril(P)^T @ grad_avg per head. */
void tango_grad_gates(i64 H, i64 T, i64 W, const float *P, const float *D, float *OUT, i64 i0, i64 i1,
                      int n_threads) {
    i64 ld = H * W, n_col = (W + NB - 1) / NB;
#pragma omp parallel for collapse(2) schedule(static) num_threads(n_threads)
    for (i64 item = i0; item < i1; item++) {
        for (i64 ci = 0; ci < n_col; ci++) {
            i64 base = (item / H) * T * ld + (item % H) * W;
            grad_gates_columns(T, W, ld, ci * NB, P + item * T * T, D + base, OUT + base);
        }
    }
}

/* Sources s0 .. s0+NB-1 (columns of out [T, T]) of one head's grad_probs[t, s] = grad_avg[t] . g[s]
   for s <= t, 0 above the diagonal. The block's gates are transposed once into `pack` (W * NB
   floats) and reused by every destination tile at or below the block; a tile computes only the
   vectors of sources that its last row sees. */
static void grad_probs_sources(i64 T, i64 W, i64 ld, i64 s0, const float *d, const float *g, float *out, float *pack) {
    i64 cols = min64(NB, T - s0);
    for (i64 t = 0; t < T; t++) memset(out + t * T + s0, 0, cols * sizeof(float));
    for (i64 k0 = 0; k0 < W; k0 += 16) { /* transpose in 16 x 16 tiles, the last one possibly narrower */
        int kn = (int)min64(16, W - k0);
        for (i64 j0 = 0; j0 < NB; j0 += 16) {
            float tile[16][16];
            for (int jj = 0; jj < 16; jj++) {
                i64 j = j0 + jj;
                memcpy(tile[jj], g + (s0 + (j < cols ? j : cols - 1)) * ld + k0, kn * sizeof(float));
            }
            for (int kk = 0; kk < kn; kk++)
                for (int jj = 0; jj < 16; jj++) pack[(k0 + kk) * NB + j0 + jj] = tile[jj][kk];
        }
    }
    for (i64 t0 = (s0 / R) * R; t0 < T; t0 += R) {
        i64 rows = min64(R, T - t0);
        i64 reach = min64(t0 + rows - s0, cols); /* sources s0 .. s0+reach-1 are seen */
        int nv = (int)((reach + VL - 1) / VL);
        vec acc[R][CV];
#define PROBS_TILE(n) grad_probs_tile(n, t0, rows, W, d, ld, pack, acc)
        BY_WIDTH(nv, PROBS_TILE)
#undef PROBS_TILE
        for (int r = 0; r < rows; r++) {
            i64 t = t0 + r;
            float row[NB];
            for (int j = 0; j < nv; j++) store(row + VL * j, acc[r][j]);
            for (i64 j = 0; j < reach && s0 + j <= t; j++) out[t * T + s0 + j] = row[j];
        }
    }
}

/* grad_probs [B, H, T, T] from grad_avg and g. Returns 1 if a scratch buffer could not be allocated. */
int tango_grad_probs(i64 H, i64 T, i64 W, const float *D, const float *G, float *OUT, i64 i0, i64 i1, int n_threads) {
    i64 ld = H * W, n_blocks = (T + NB - 1) / NB;
    int failed = 0;
#pragma omp parallel for collapse(2) schedule(static) num_threads(n_threads) reduction(| : failed)
    for (i64 item = i0; item < i1; item++) {
        for (i64 sb = 0; sb < n_blocks; sb++) {
            float *pack = malloc(sizeof(float) * W * NB);
            if (!pack) {
                failed = 1;
                continue;
            }
            i64 base = (item / H) * T * ld + (item % H) * W;
            grad_probs_sources(T, W, ld, sb * NB, D + base, G + base, OUT + item * T * T, pack);
            free(pack);
        }
    }
    return failed;
}

/* 1 when built with OpenMP: the loops above then run on the OpenMP threads PyTorch itself uses. */
int tango_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}
