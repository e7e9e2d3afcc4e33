/* A strided copy or add in square tiles: the CPU kernel behind posenc.native.copy_tiled.
 *
 * dst[b, h, i, j] = src[b, h, i, j]   (or +=, with accumulate)
 *
 * over (B, H, I, J), dst with a unit stride along J and src with any strides. It is
 * for sources whose fast axis is not J: DeBERTa's position-to-content term is a
 * key-major table read as a (query, key) matrix, so walking a row of the score
 * buffer walks a column of the table, one cache line per element. PyTorch's add
 * walks the destination in row order and pays that for every element; here a
 * TILE x TILE block of both sides stays in the L1 cache while it is walked, so a
 * line that is read once serves all of its elements.
 *
 * dst: strides (d0, d1, d2, 1). src: strides (s0, s1, s2, s3); 0 broadcasts.
 *
 * Within a tile the inner loop runs along J (src read with stride s3) or along I (dst
 * written with stride d2), whichever of the two strides is smaller. The other order
 * can hit a power-of-two stride: the p2c gradient is read from the score buffer's
 * columns, S floats apart, and 32 lines 4 KiB apart share one L1 set, which evicts a
 * line before its neighbouring elements are used (4x slower, in a scratch timing on
 * a 2-core EPYC; PyTorch's copy was slower still).
 *
 * Threads: OpenMP, as many as the caller passes (torch.get_num_threads()), over
 * (b, h, row of tiles); inputs under 64K elements stay on one thread. Built without
 * OpenMP, it runs on one.
 */
#include <stdint.h>

#define TILE 32

#define TILE_KERNEL(NAME, T_)                                                             \
    void NAME(T_ *dst, const T_ *src, int64_t nb, int64_t nh, int64_t ni, int64_t nj,     \
              int64_t d0, int64_t d1, int64_t d2, int64_t s0, int64_t s1, int64_t s2,     \
              int64_t s3, _Bool accumulate, int threads) {                                \
        const int64_t rows = (ni + TILE - 1) / TILE, units = nb * nh * rows;              \
        const int team = nb * nh * ni * nj >= 65536 ? threads : 1;                        \
        (void)team;                                                                       \
        _Pragma("omp parallel for num_threads(team) schedule(static)")                    \
        for (int64_t u = 0; u < units; u++) {                                             \
            const int64_t bh = u / rows, i0 = (u % rows) * TILE;                          \
            const int64_t b = bh / nh, h = bh % nh;                                       \
            const int64_t i1 = ni < i0 + TILE ? ni : i0 + TILE;                           \
            T_ *d = dst + b * d0 + h * d1;                                                \
            const T_ *s = src + b * s0 + h * s1;                                          \
            for (int64_t j0 = 0; j0 < nj; j0 += TILE) {                                   \
                const int64_t j1 = nj < j0 + TILE ? nj : j0 + TILE;                       \
                if (s3 <= d2) {                                                           \
                    for (int64_t i = i0; i < i1; i++) {                                   \
                        T_ *dr = d + i * d2;                                              \
                        const T_ *sr = s + i * s2;                                        \
                        if (accumulate)                                                   \
                            for (int64_t j = j0; j < j1; j++) dr[j] += sr[j * s3];        \
                        else                                                              \
                            for (int64_t j = j0; j < j1; j++) dr[j] = sr[j * s3];         \
                    }                                                                     \
                } else {                                                                  \
                    for (int64_t j = j0; j < j1; j++) {                                   \
                        T_ *dc = d + j;                                                   \
                        const T_ *sc = s + j * s3;                                        \
                        if (accumulate)                                                   \
                            for (int64_t i = i0; i < i1; i++) dc[i * d2] += sc[i * s2];   \
                        else                                                              \
                            for (int64_t i = i0; i < i1; i++) dc[i * d2] = sc[i * s2];    \
                    }                                                                     \
                }                                                                         \
            }                                                                             \
        }                                                                                 \
    }

TILE_KERNEL(posenc_tiled_f32, float)
TILE_KERNEL(posenc_tiled_f64, double)
