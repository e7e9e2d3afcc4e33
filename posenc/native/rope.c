/* RoPE in one pass over q or k: the CPU kernel behind posenc.native.rope.
 *
 * y[b, h, t, :] = rotate(x[b, h, t, :]) with the angles of row t (table row b when the
 * tables are per batch). The first R dims rotate in pairs, the rest are copied:
 *   interleaved: pair i is (2i, 2i+1)      y0 = x0 c - x1 s,  y1 = x1 c + x0 s
 *   half:        pair i is (i, i + R/2)    (the same map on the split-half layout)
 * with c, s the tables' entries for (t, i) (cos and sin of t theta_i, possibly scaled)
 * and s multiplied by sign. sign = -1 applies the transpose: the backward pass.
 *
 * x: strides (xs0, xs1, xs2) over (B, H, T), unit stride over D. y: contiguous.
 * Tables, strides (cs0, cs1) over (batch, T), unit stride last, cs0 = 0 when all batch
 * rows share them:
 *   half:        cosv and sinv, (B|1, T, R/2) each;
 *   interleaved: cosv alone, (B|1, T, R) with (c, s) of pair i at 2i, 2i+1, laid out
 *                as x's pairs, so that one vector load holds the factors of the pairs
 *                of one vector of x; sinv is not read.
 *
 * Order: positions outer, GROUP (batch, head) rows inner, so each table row is read
 * once for GROUP rows of x while x is read as GROUP sequential streams. In plain row
 * order the table is re-read for every row and the pass was clearly slower than a copy
 * (a scratch timing on a 2-core EPYC); 2 or 4 streams beat the copy, 8 were too many.
 * experiments/bench.py times the result against a copy.
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
 * contiguous range of (group, position) units; inputs under 64K elements stay on one
 * thread. Built without OpenMP, it runs on one.
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

/* The span loop of kernel NAME with the group size and R = D = D_ known to the
 * compiler (a full group; a short last group passes its n), for either layout. */
#define POSENC_SPAN(NAME, N_, D_)                                                         \
    do {                                                                                \
        if (half_layout)                                                                \
            NAME##_span(xg, yg, cg, sg, N_, t0, t1, xs2, cs1, D_, D_, 1, sign);           \
        else                                                                            \
            NAME##_span(xg, yg, cg, sg, N_, t0, t1, xs2, cs1, D_, D_, 0, sign);           \
    } while (0)
#define POSENC_SPANS(NAME, D_)                                                          \
    do {                                                                                \
        if (n == GROUP)                                                                 \
            POSENC_SPAN(NAME, GROUP, D_);                                               \
        else                                                                            \
            POSENC_SPAN(NAME, n, D_);                                                   \
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
        int64_t n, int64_t t0, int64_t t1, int64_t xs2, int64_t cs1, int64_t d,           \
        int64_t r, _Bool half_layout, T_ sign) {                                          \
        for (int64_t t = t0; t < t1; t++)                                                 \
            for (int64_t g = 0; g < n; g++) {                                             \
                if (half_layout)                                                          \
                    NAME##_halves(xg[g] + t * xs2, yg[g] + t * d, cg[g] + t * cs1,        \
                                  sg[g] + t * cs1, d, r, sign);                           \
                else                                                                      \
                    NAME##_pairs(xg[g] + t * xs2, yg[g] + t * d, cg[g] + t * cs1, d, r,   \
                                 sign);                                                   \
            }                                                                             \
    }                                                                                     \
                                                                                          \
    POSENC_CLONES void NAME(const T_ *x, T_ *y, const T_ *cosv, const T_ *sinv,           \
                            int64_t nb, int64_t nh, int64_t nt, int64_t d, int64_t r,     \
                            int64_t xs0, int64_t xs1, int64_t xs2, int64_t cs0,           \
                            int64_t cs1, _Bool half_layout, T_ sign, int threads) {       \
        const int64_t nbh = nb * nh, groups = (nbh + GROUP - 1) / GROUP;                  \
        const int team = nbh * nt * d >= 65536 ? threads : 1;                             \
        (void)team;                                                                       \
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
                    yg[g] = y + (bh0 + g) * nt * d;                                       \
                    cg[g] = cosv + b * cs0;                                               \
                    sg[g] = half_layout ? sinv + b * cs0 : cg[g];                         \
                }                                                                         \
                if (d == r && d == 64)                                                    \
                    POSENC_SPANS(NAME, 64);                                               \
                else if (d == r && d == 128)                                              \
                    POSENC_SPANS(NAME, 128);                                              \
                else if (d == r && d == 32)                                               \
                    POSENC_SPANS(NAME, 32);                                               \
                else                                                                      \
                    NAME##_span(xg, yg, cg, sg, n, t0, t1, xs2, cs1, d, r, half_layout,   \
                                sign);                                                    \
                u += t1 - t0;                                                             \
            }                                                                             \
        }                                                                                 \
    }

ROPE_KERNEL(posenc_rope_f32, float)
ROPE_KERNEL(posenc_rope_f64, double)
