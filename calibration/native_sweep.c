/* Fused one-read sweep over a row-major (N, K) probability matrix: the native kernel behind
 * calibration.native_sweep (which compiles this file on first use and calls it with ctypes).
 *
 * Per row i (probabilities p_i0 .. p_i,K-1, label y_i, already validated to lie in [0, K)):
 *   validation  no entry compares below zero (-0.0 is an ordinary zero) and
 *               |sum_k p_ik - 1| <= tolerance (NaN or Inf anywhere make the sum fail it);
 *   confidence  m_i = max_k p_ik, taken as the maximum of the bit patterns (which orders
 *               non-negative floats exactly as their values do, -0.0 lowest of all);
 *   correct     the first k with p_ik == m_i (argmax semantics) equals y_i;
 *   label prob  p_iy;
 *   squares     sum_k p_ik^2 in double (a float32 square is exact in double), optional;
 *   bins        the confidence's bin among the given edges, and per-bin count, sum of confidence
 *               and number correct, optional.
 * Rows are processed in blocks of `block_rows`; each block writes its own partial sums, so the
 * totals do not depend on how many threads shared the blocks.
 *
 * Returns 0 when every row passed validation, 1 otherwise; the caller then re-examines the
 * array exactly, to say what is wrong.
 */
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) && !defined(BFL_PORTABLE)
#include <immintrin.h>
#define BFL_AVX512 1
#else
#define BFL_AVX512 0
#endif

/* Rows are read strictly in order, but each row also ends in dependent reduction chains, and
 * the hardware prefetcher alone then leaves the core waiting on DRAM (measured: 1.6x slower on
 * one thread without the explicit prefetch). */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 4096
#endif
#define CACHE_LINE 64

/* 1 when this build uses the AVX-512 float32 path, 0 for the portable loops. */
int bfl_sweep_variant(void) { return BFL_AVX512; }

/* Bin of confidence c among nondecreasing edges e[0..nb]: the i with e[i] <= c < e[i+1], the
 * last bin closed. c * nb is a guess that rounding can move across an edge; the loops settle
 * it against the edges themselves, so the result is exact for any edges. */
#define DEFINE_BIN_INDEX(SUFFIX, T)                                                          \
    static inline int64_t bin_index_##SUFFIX(T c, const T *e, int64_t nb) {                  \
        int64_t i = (int64_t)(c * (T)nb);                                                    \
        if (i > nb - 1) i = nb - 1;                                                          \
        if (i < 0) i = 0;                                                                    \
        while (i > 0 && c < e[i]) --i;                                                       \
        while (i < nb - 1 && c >= e[i + 1]) ++i;                                             \
        return i;                                                                            \
    }
DEFINE_BIN_INDEX(f32, float)
DEFINE_BIN_INDEX(f64, double)

/* Everything after the row's reductions: validity, argmax, outputs and bins. Returns 0 for an
 * invalid row (its outputs are left unwritten), 1 otherwise. */
#define DEFINE_FINISH_ROW(SUFFIX, T, BITS, MAX_FINITE)                                       \
    static inline int finish_row_##SUFFIX(                                                   \
        const T *r, int64_t i, int64_t first, BITS max_bits, T row_sum, T tolerance,         \
        const int64_t *labels, T *top, T *label_prob, uint8_t *correct, const T *edges,      \
        int64_t nb, int64_t *bin_count, double *bin_confidence, int64_t *bin_correct) {      \
        T deviation = row_sum - (T)1;                                                        \
        if (max_bits > (BITS)(MAX_FINITE) || !(deviation <= tolerance && -deviation <= tolerance)) \
            return 0;                                                                        \
        T m;                                                                                 \
        memcpy(&m, &max_bits, sizeof m);                                                     \
        int64_t y = labels[i];                                                               \
        int hit = first == y;                                                                \
        if (top) top[i] = m;                                                                 \
        if (label_prob) label_prob[i] = r[y];                                                \
        if (correct) correct[i] = (uint8_t)hit;                                              \
        if (edges) {                                                                         \
            int64_t b = bin_index_##SUFFIX(m, edges, nb);                                    \
            bin_count[b] += 1;                                                               \
            bin_confidence[b] += (double)m;                                                  \
            bin_correct[b] += hit;                                                           \
        }                                                                                    \
        return 1;                                                                            \
    }
DEFINE_FINISH_ROW(f32, float, int32_t, 0x7f7fffff)
DEFINE_FINISH_ROW(f64, double, int64_t, 0x7fefffffffffffffLL)

/* Portable block sweep (any dtype, any ISA): vectorizable loops, bit patterns via memcpy. */
#define DEFINE_PORTABLE_BLOCK(SUFFIX, T, BITS, BITS_MIN)                                    \
    static __attribute__((unused)) int block_portable_##SUFFIX(                             \
        const T *probs, const int64_t *labels, int64_t row0, int64_t row1, int64_t k,        \
        T tolerance, T *top, T *label_prob, uint8_t *correct, double *squares,               \
        const T *edges, int64_t nb, int64_t *bin_count, double *bin_confidence,              \
        int64_t *bin_correct) {                                                              \
        const int64_t ahead = PREFETCH_BYTES / (int64_t)sizeof(T);                           \
        const int64_t line = CACHE_LINE / (int64_t)sizeof(T);                                \
        double square_total = 0.0;                                                           \
        T block_min = 0;                                                                     \
        int ok = 1;                                                                          \
        for (int64_t i = row0; i < row1; ++i) {                                              \
            const T *r = probs + i * k;                                                      \
            for (int64_t c = 0; c < k; c += line) __builtin_prefetch(r + ahead + c);         \
            BITS max_bits = BITS_MIN;                                                        \
            T row_sum = 0, row_min = 0;                                                      \
            double row_squares = 0.0;                                                        \
            _Pragma("omp simd reduction(max:max_bits) reduction(min:row_min) reduction(+:row_sum, row_squares)") \
            for (int64_t j = 0; j < k; ++j) {                                                \
                BITS v;                                                                      \
                memcpy(&v, r + j, sizeof v);                                                 \
                max_bits = v > max_bits ? v : max_bits;                                      \
                row_min = r[j] < row_min ? r[j] : row_min;                                   \
                row_sum += r[j];                                                             \
                row_squares += (double)r[j] * (double)r[j];                                  \
            }                                                                                \
            block_min = row_min < block_min ? row_min : block_min;                           \
            square_total += row_squares;                                                     \
            T m;                                                                             \
            memcpy(&m, &max_bits, sizeof m);                                                 \
            int64_t first = 0; /* bounded: NaN rows never match and are rejected anyway */   \
            if (correct || edges)                                                            \
                while (first < k - 1 && r[first] != m) ++first;                              \
            ok &= finish_row_##SUFFIX(r, i, first, max_bits, row_sum, tolerance, labels, top, \
                                      label_prob, correct, edges, nb, bin_count,             \
                                      bin_confidence, bin_correct);                          \
        }                                                                                    \
        if (squares) *squares = square_total;                                                \
        return ok && block_min >= 0;                                                         \
    }
DEFINE_PORTABLE_BLOCK(f32, float, int32_t, INT32_MIN)
DEFINE_PORTABLE_BLOCK(f64, double, int64_t, INT64_MIN)

#if BFL_AVX512
/* Squares of 16 floats added, in double, into two accumulators of 8. */
static inline void add_squares(__m512 v, __m512d *low, __m512d *high) {
    __m512d a = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
    __m512d b = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    *low = _mm512_fmadd_pd(a, a, *low);
    *high = _mm512_fmadd_pd(b, b, *high);
}

/* Per-lane running state of one row: lane l sees entries l, l + 16, l + 32, ... */
typedef struct {
    __m512i max;    /* largest bit pattern so far (orders non-negative floats) */
    __m512i first;  /* position where that lane first reached it */
    __m512 sum;
} Lanes;

static inline Lanes lanes_start(void) {
    Lanes lanes = {_mm512_set1_epi32(INT32_MIN), _mm512_setzero_si512(), _mm512_setzero_ps()};
    return lanes;
}

/* Absorb 16 entries at `position` (their indices). A strictly greater value moves a lane's
 * maximum and records where, so each lane keeps the first position of its maximum. */
static inline void lanes_absorb(Lanes *lanes, __m512 v, __m512i position, __mmask16 valid,
                                const int want_argmax) {
    __m512i bits = _mm512_castps_si512(v);
    if (want_argmax) {
        __mmask16 higher = _mm512_mask_cmpgt_epi32_mask(valid, bits, lanes->max);
        lanes->max = _mm512_mask_mov_epi32(lanes->max, higher, bits);
        lanes->first = _mm512_mask_mov_epi32(lanes->first, higher, position);
    } else {
        lanes->max = _mm512_mask_max_epi32(lanes->max, valid, lanes->max, bits);
    }
    lanes->sum = _mm512_add_ps(lanes->sum, v);
}

/* The float32 block sweep with 512-bit vectors, two independent lane sets per row (a, b) to
 * halve the dependency chains. The minimum and the squares are carried across rows; per row
 * only the maximum, the sum and (if wanted) the argmax are reduced across lanes, without a
 * data-dependent branch. WANT_* are compile-time constants at each call site. */
static inline __attribute__((always_inline)) int block_avx512_impl(
    const float *probs, const int64_t *labels, int64_t row0, int64_t row1, int64_t k,
    float tolerance, float *top, float *label_prob, uint8_t *correct, double *squares,
    const float *edges, int64_t nb, int64_t *bin_count, double *bin_confidence,
    int64_t *bin_correct, const int want_squares, const int want_argmax) {
    const int64_t full = k & ~(int64_t)15;
    const __mmask16 tail = (__mmask16)((1u << (k & 15)) - 1u);
    const int64_t ahead = PREFETCH_BYTES / (int64_t)sizeof(float);
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i step16 = _mm512_set1_epi32(16), step32 = _mm512_set1_epi32(32);
    __m512 block_min = _mm512_setzero_ps();  /* min(0, entries): NaN operands are skipped */
    __m512d sq_low = _mm512_setzero_pd(), sq_high = _mm512_setzero_pd();
    int ok = 1;
    for (int64_t i = row0; i < row1; ++i) {
        const float *r = probs + i * k;
        for (int64_t c = 0; c < k; c += 16) _mm_prefetch((const char *)(r + ahead + c), _MM_HINT_T0);
        Lanes a = lanes_start(), b = lanes_start();
        __m512i position = iota;
        int64_t j = 0;
        for (; j + 32 <= full; j += 32) {
            __m512 v = _mm512_loadu_ps(r + j), w = _mm512_loadu_ps(r + j + 16);
            lanes_absorb(&a, v, position, 0xFFFF, want_argmax);
            lanes_absorb(&b, w, _mm512_add_epi32(position, step16), 0xFFFF, want_argmax);
            block_min = _mm512_min_ps(_mm512_min_ps(v, w), block_min);
            if (want_squares) {
                add_squares(v, &sq_low, &sq_high);
                add_squares(w, &sq_low, &sq_high);
            }
            position = _mm512_add_epi32(position, step32);
        }
        for (; j < full; j += 16) {
            __m512 v = _mm512_loadu_ps(r + j);
            lanes_absorb(&a, v, position, 0xFFFF, want_argmax);
            block_min = _mm512_min_ps(v, block_min);
            if (want_squares) add_squares(v, &sq_low, &sq_high);
            position = _mm512_add_epi32(position, step16);
        }
        if (tail) {  /* masked-off lanes load as 0.0 and are kept out of the maximum */
            __m512 v = _mm512_maskz_loadu_ps(tail, r + j);
            lanes_absorb(&b, v, position, tail, want_argmax);
            block_min = _mm512_min_ps(v, block_min);
            if (want_squares) add_squares(v, &sq_low, &sq_high);
        }
        int32_t max_bits = _mm512_reduce_max_epi32(_mm512_max_epi32(a.max, b.max));
        float row_sum = _mm512_reduce_add_ps(_mm512_add_ps(a.sum, b.sum));
        int64_t first = 0;
        if (want_argmax) {  /* the smallest position among lanes holding the maximum */
            const __m512i target = _mm512_set1_epi32(max_bits), none = _mm512_set1_epi32(INT32_MAX);
            __m512i at_a = _mm512_mask_mov_epi32(none, _mm512_cmpeq_epi32_mask(a.max, target), a.first);
            __m512i at_b = _mm512_mask_mov_epi32(none, _mm512_cmpeq_epi32_mask(b.max, target), b.first);
            first = _mm512_reduce_min_epi32(_mm512_min_epi32(at_a, at_b));
        }
        ok &= finish_row_f32(r, i, first, max_bits, row_sum, tolerance, labels, top, label_prob,
                             correct, edges, nb, bin_count, bin_confidence, bin_correct);
    }
    if (squares) *squares = _mm512_reduce_add_pd(_mm512_add_pd(sq_low, sq_high));
    return ok && _mm512_reduce_min_ps(block_min) >= 0.0f;
}

static int block_avx512(const float *probs, const int64_t *labels, int64_t row0, int64_t row1,
                        int64_t k, float tolerance, float *top, float *label_prob,
                        uint8_t *correct, double *squares, const float *edges, int64_t nb,
                        int64_t *bin_count, double *bin_confidence, int64_t *bin_correct) {
#define BLOCK_AVX512(SQUARES, ARGMAX)                                                            \
    block_avx512_impl(probs, labels, row0, row1, k, tolerance, top, label_prob, correct,        \
                      squares, edges, nb, bin_count, bin_confidence, bin_correct, SQUARES, ARGMAX)
    const int argmax = correct || edges;
    if (squares) return argmax ? BLOCK_AVX512(1, 1) : BLOCK_AVX512(1, 0);
    return argmax ? BLOCK_AVX512(0, 1) : BLOCK_AVX512(0, 0);
#undef BLOCK_AVX512
}
#endif

/* Sweep blocks [block_begin, block_end) of block_rows rows each (the last may be short).
 * Per-block outputs: squares[b] (nullable), and bin_count / bin_confidence / bin_correct at
 * [b * n_bins, (b + 1) * n_bins) (all null iff edges is null). Per-row outputs (nullable):
 * top, label_prob (input dtype) and correct (0/1 bytes). */
#define DEFINE_ENTRY(SUFFIX, T, BLOCK)                                                       \
    int bfl_sweep_##SUFFIX(const T *probs, const int64_t *labels, int64_t n_rows,            \
                           int64_t n_classes, int64_t block_rows, int64_t block_begin,       \
                           int64_t block_end, double tolerance, T *top, T *label_prob,       \
                           uint8_t *correct, double *squares, const T *edges,               \
                           int64_t n_bins, int64_t *bin_count, double *bin_confidence,       \
                           int64_t *bin_correct) {                                           \
        int ok = 1;                                                                          \
        for (int64_t b = block_begin; b < block_end; ++b) {                                  \
            int64_t row0 = b * block_rows;                                                   \
            int64_t row1 = row0 + block_rows < n_rows ? row0 + block_rows : n_rows;          \
            int64_t off = edges ? b * n_bins : 0;                                            \
            ok &= BLOCK(probs, labels, row0, row1, n_classes, (T)tolerance, top, label_prob, \
                        correct, squares ? squares + b : NULL, edges, n_bins,                \
                        edges ? bin_count + off : NULL, edges ? bin_confidence + off : NULL, \
                        edges ? bin_correct + off : NULL);                                   \
        }                                                                                    \
        return ok ? 0 : 1;                                                                   \
    }
#if BFL_AVX512
DEFINE_ENTRY(f32, float, block_avx512)
#else
DEFINE_ENTRY(f32, float, block_portable_f32)
#endif
DEFINE_ENTRY(f64, double, block_portable_f64)
