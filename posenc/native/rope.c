/* RoPE in one pass over q or k: the CPU kernel behind posenc.native.rope.
 *
 * y[b, h, t, :] = rotate(x[b, h, t, :]) with the angles of row t (table row b when the
 * tables are per batch). The first R dims rotate in pairs, the rest are copied:
 *   interleaved: pair i is (2i, 2i+1)      y0 = x0 c - x1 s,  y1 = x1 c + x0 s
 *   half:        pair i is (i, i + R/2)    (the same map on the split-half layout)
 * with c, s the tables' entries for (t, i) (cos and sin of t theta_i, possibly scaled)
 * and s multiplied by sign. sign = -1 applies the transpose: the backward pass.
 *
 * x: strides (xs0, xs1, xs2) over (B, H, T), unit stride over D; y: (ys0, ys1, ys2)
 * likewise. posenc.native.rope allocates y in the order the kernel walks (below).
 * Tables, strides (cs0, cs1) over (batch, T), unit stride last, cs0 = 0 when all batch
 * rows share them:
 *   half:        cosv and sinv, (B|1, T, R/2) each;
 *   interleaved: cosv alone, (B|1, T, R) with (c, s) of pair i at 2i, 2i+1, laid out
 *                as x's pairs, so that one vector load holds the factors of the pairs
 *                of one vector of x; sinv is not read.
 *
 * Order: each of the two memory orders of q and k that occur gets the loop order that
 * walks x and y front to back and reads each table row once for several rows of x.
 *  - Heads adjacent (xs1 < xs2): the attention layer's q and k, views (B, H, T, D) of
 *    a (B, T, H, D) projection. The work units are (b, t): the H rows of a position
 *    lie side by side in x and y and share one table row. With y contiguous instead
 *    (the kernel before it took y's strides), the pass ran at 0.36-0.55x a copy of
 *    the same views (scratch timings on a 2-core EPYC); in this order at 0.95-1.09x
 *    (six runs of experiments/bench.py).
 *  - Positions adjacent (contiguous (B, H, T, D)): positions outer, GROUP (batch,
 *    head) rows inner, so x is read as GROUP sequential streams. In plain row order
 *    the table is re-read for every row and the pass was clearly slower than a copy
 *    (a scratch timing); 2 or 4 streams beat the copy, 8 were too many.
 * experiments/bench.py times both against a copy.
 *
 * Row length: the row loops are short (D/2 pairs), so their trip count, the aliasing
 * checks and the vector epilogue take a large share of the time unless the compiler
 * knows D and R. The kernel therefore calls its loop body with constant (D, R, layout,
 * rows in the group) for the usual head sizes (R = D = 32, 64 or 128) and with
 * run-time values otherwise.
 *
 * The pass is memory-bound only while the arithmetic keeps up; on a shared machine it
 * often does not, and a plain add needs fewer instructions than a rotation. Measured
 * on the 2-core EPYC (scratch timings, not kept), G elements/s on one core, data in L2,
 * the kernel called in a C loop, three runs: interleaved 4.9 with separate cos/sin
 * tables and run-time sizes, 5.8 with the compiled sizes, 7.3 with the pair table too;
 * half 5.5 -> 7.2 -> 7.8; a C loop adding 0 to every element 12.
 *
 * Threads: OpenMP, as many as the caller passes (torch.get_num_threads()), each on a
 * contiguous range of the order's units (positions, or (group, position) pairs); inputs
 * under 64K elements stay on one thread. Built without OpenMP, it runs on one.
 */
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* GCC on x86-64: an AVX2 copy of each kernel beside the baseline one, picked at load
 * time by the CPU it runs on (so one build serves every node of a cluster). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define POSENC_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define POSENC_CLONES
#endif

#define GROUP 4

#if defined(__GNUC__) || defined(__clang__)
#define POSENC_INLINE __attribute__((always_inline))
#else
#define POSENC_INLINE
#endif

/* CALL(NAME, D_, R_, HALF_) with (D, R, layout) known to the compiler for R = D = 32, 64
 * or 128 and either layout; with run-time values otherwise. */
#define POSENC_BY_LAYOUT(NAME, CALL, D_)                                                   \
    do {                                                                                  \
        if (half_layout)                                                                  \
            CALL(NAME, D_, D_, 1);                                                        \
        else                                                                              \
            CALL(NAME, D_, D_, 0);                                                        \
    } while (0)
#define POSENC_BY_SIZE(NAME, CALL)                                                        \
    do {                                                                                  \
        if (d == r && d == 64)                                                            \
            POSENC_BY_LAYOUT(NAME, CALL, 64);                                             \
        else if (d == r && d == 128)                                                      \
            POSENC_BY_LAYOUT(NAME, CALL, 128);                                            \
        else if (d == r && d == 32)                                                       \
            POSENC_BY_LAYOUT(NAME, CALL, 32);                                             \
        else                                                                              \
            CALL(NAME, d, r, half_layout);                                                \
    } while (0)
/* The H rows of one position; a group's span of positions, the group size known to the
 * compiler when the group is full. */
#define POSENC_HEADS(NAME, D_, R_, HALF_)                                                 \
    NAME##_heads(xr, yr, c, sn, nh, xs1, ys1, D_, R_, HALF_, sign)
#define POSENC_GROUP(NAME, D_, R_, HALF_)                                                 \
    do {                                                                                  \
        if (n == GROUP)                                                                   \
            NAME##_span(xg, yg, cg, sg, GROUP, t0, t1, xs2, ys2, cs1, D_, R_, HALF_, sign); \
        else                                                                              \
            NAME##_span(xg, yg, cg, sg, n, t0, t1, xs2, ys2, cs1, D_, R_, HALF_, sign);     \
    } while (0)

/* This thread's share [*u0, *u1) of n units. */
static void thread_share(int64_t n, int64_t *u0, int64_t *u1) {
    int64_t id = 0, count = 1;
#ifdef _OPENMP
    id = omp_get_thread_num();
    count = omp_get_num_threads();
#endif
    *u0 = n * id / count;
    *u1 = n * (id + 1) / count;
}

#define ROPE_KERNEL(NAME, T_)                                                             \
    /* interleaved: pair i is (x[2i], x[2i+1]); p[2i], p[2i+1] hold its (c, s). */       \
    static inline POSENC_INLINE void NAME##_pairs(                                        \
        const T_ *restrict xr, T_ *restrict yr, const T_ *restrict p, int64_t d,          \
        int64_t r, T_ sign) {                                                             \
        for (int64_t i = 0; i < r / 2; i++) {                                             \
            const T_ c = p[2 * i], si = sign * p[2 * i + 1];                              \
            const T_ x0 = xr[2 * i], x1 = xr[2 * i + 1];                                  \
            yr[2 * i] = x0 * c - x1 * si;                                                 \
            yr[2 * i + 1] = x1 * c + x0 * si;                                             \
        }                                                                                 \
        for (int64_t j = r; j < d; j++) yr[j] = xr[j];                                    \
    }                                                                                     \
                                                                                          \
    /* half: pair i is (x[i], x[i + R/2]); c[i], s[i] hold its (c, s). */                 \
    static inline POSENC_INLINE void NAME##_halves(                                       \
        const T_ *restrict xr, T_ *restrict yr, const T_ *restrict c,                     \
        const T_ *restrict s, int64_t d, int64_t r, T_ sign) {                            \
        const int64_t h2 = r / 2;                                                         \
        for (int64_t i = 0; i < h2; i++) {                                                \
            const T_ x0 = xr[i], x1 = xr[i + h2], si = sign * s[i];                       \
            yr[i] = x0 * c[i] - x1 * si;                                                  \
            yr[i + h2] = x1 * c[i] + x0 * si;                                             \
        }                                                                                 \
        for (int64_t j = r; j < d; j++) yr[j] = xr[j];                                    \
    }                                                                                     \
                                                                                          \
    /* Positions [t0, t1) of the n rows of one group. */                                 \
    static inline POSENC_INLINE void NAME##_span(                                         \
        const T_ *const *xg, T_ *const *yg, const T_ *const *cg, const T_ *const *sg,     \
        int64_t n, int64_t t0, int64_t t1, int64_t xs2, int64_t ys2, int64_t cs1,         \
        int64_t d, int64_t r, _Bool half_layout, T_ sign) {                               \
        for (int64_t t = t0; t < t1; t++)                                                 \
            for (int64_t g = 0; g < n; g++) {                                             \
                if (half_layout)                                                          \
                    NAME##_halves(xg[g] + t * xs2, yg[g] + t * ys2, cg[g] + t * cs1,      \
                                  sg[g] + t * cs1, d, r, sign);                           \
                else                                                                      \
                    NAME##_pairs(xg[g] + t * xs2, yg[g] + t * ys2, cg[g] + t * cs1, d, r, \
                                 sign);                                                   \
            }                                                                             \
    }                                                                                     \
                                                                                          \
    /* The nh rows of one position, at strides xs1 (x) and ys1 (y), one table row. */    \
    static inline POSENC_INLINE void NAME##_heads(                                        \
        const T_ *xr, T_ *yr, const T_ *c, const T_ *sn, int64_t nh, int64_t xs1,         \
        int64_t ys1, int64_t d, int64_t r, _Bool half_layout, T_ sign) {                  \
        for (int64_t h = 0; h < nh; h++) {                                                \
            if (half_layout)                                                              \
                NAME##_halves(xr + h * xs1, yr + h * ys1, c, sn, d, r, sign);             \
            else                                                                          \
                NAME##_pairs(xr + h * xs1, yr + h * ys1, c, d, r, sign);                  \
        }                                                                                 \
    }                                                                                     \
                                                                                          \
    POSENC_CLONES void NAME(const T_ *x, T_ *y, const T_ *cosv, const T_ *sinv,           \
                            int64_t nb, int64_t nh, int64_t nt, int64_t d, int64_t r,     \
                            int64_t xs0, int64_t xs1, int64_t xs2, int64_t ys0,           \
                            int64_t ys1, int64_t ys2, int64_t cs0, int64_t cs1,           \
                            _Bool half_layout, T_ sign, int threads) {                    \
        const int team = nb * nh * nt * d >= 65536 ? threads : 1;                         \
        (void)team;                                                                       \
        if (xs1 < xs2) { /* heads adjacent: units are positions (b, t) */                 \
            _Pragma("omp parallel num_threads(team)") {                                   \
                int64_t u, u1;                                                            \
                thread_share(nb * nt, &u, &u1);                                           \
                for (; u < u1; u++) {                                                     \
                    const int64_t b = u / nt, t = u % nt;                                 \
                    const T_ *xr = x + b * xs0 + t * xs2;                                 \
                    T_ *yr = y + b * ys0 + t * ys2;                                       \
                    const T_ *c = cosv + b * cs0 + t * cs1;                               \
                    const T_ *sn = half_layout ? sinv + b * cs0 + t * cs1 : c;            \
                    POSENC_BY_SIZE(NAME, POSENC_HEADS);                                   \
                }                                                                         \
            }                                                                             \
            return;                                                                       \
        }                                                                                 \
        /* positions adjacent: units are (group of rows, position) */                    \
        const int64_t nbh = nb * nh, groups = (nbh + GROUP - 1) / GROUP;                  \
        _Pragma("omp parallel num_threads(team)") {                                       \
            int64_t u, u1;                                                                \
            thread_share(groups * nt, &u, &u1);                                           \
            while (u < u1) {                                                              \
                const int64_t bh0 = (u / nt) * GROUP, t0 = u % nt;                        \
                const int64_t t1 = nt < t0 + u1 - u ? nt : t0 + u1 - u;                   \
                const int64_t n = nbh - bh0 < GROUP ? nbh - bh0 : GROUP;                  \
                const T_ *xg[GROUP] = {0}, *cg[GROUP] = {0}, *sg[GROUP] = {0};            \
                T_ *yg[GROUP] = {0};                                                      \
                for (int64_t g = 0; g < n; g++) {                                         \
                    const int64_t b = (bh0 + g) / nh, hh = (bh0 + g) % nh;                \
                    xg[g] = x + b * xs0 + hh * xs1;                                       \
                    yg[g] = y + b * ys0 + hh * ys1;                                       \
                    cg[g] = cosv + b * cs0;                                               \
                    sg[g] = half_layout ? sinv + b * cs0 : cg[g];                         \
                }                                                                         \
                POSENC_BY_SIZE(NAME, POSENC_GROUP);                                       \
                u += t1 - t0;                                                             \
            }                                                                             \
        }                                                                                 \
    }

ROPE_KERNEL(posenc_rope_f32, float)
ROPE_KERNEL(posenc_rope_f64, double)
