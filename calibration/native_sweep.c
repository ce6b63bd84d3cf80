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

/* Portable block sweep: GCC/clang vector extensions only, no intrinsics. Vectors are as wide as
 * the target's integer vectors (32 bytes with AVX2, else 16: SSE2, NEON), so one source becomes
 * AVX2 code with -march=native on an AVX2 machine, SSE2 on a plain x86-64 target and NEON on
 * arm64 (vectors wider than the target's are split, and their compares made scalar).
 *
 * The scheme is that of the AVX-512 path. Two lane sets per row (a, b) keep, in each lane, the
 * largest bit pattern so far (a signed compare, which orders non-negative floats as their
 * values do) and the position where the lane first reached it (only a strictly greater pattern
 * moves it). The argmax is the smallest position among the lanes that hold the row maximum:
 * the first index of the maximum, as numpy.argmax has it. One vector sum per row, reduced at
 * its end; the squares (in double) and the negativity test are carried across rows (the sums
 * and squares of a pair of vectors are added first: fewer registers, no spills on SSE2). An
 * entry is negative when its sign bit is set and the rest is not all zero: exactly the entries
 * that compare below zero (-0.0 does not, and a denormals-are-zero mode changes nothing), and
 * -NaN, whose row fails the sum test anyway. The entries after the last whole vector come in
 * one vector that ends at the row's last entry; its lanes that repeat earlier entries are set
 * to -0.0, whose bit pattern is the lowest of all (never strictly above a lane's maximum) and
 * which changes no sum, square or negativity test.
 *
 * x86 before SSE4.2 has no 64-bit integer compare: there the float64 lanes compare values
 * instead of bit patterns. Both order the entries of a valid row (non-negative or -0.0) alike,
 * and a row with a NaN, an Inf or a negative entry is rejected either way. */
#if defined(__AVX2__)
#define BFL_VECTOR_BYTES 32
#else
#define BFL_VECTOR_BYTES 16
#endif
#if defined(__x86_64__) || defined(__i386__)
#define BFL_X86 1
#else
#define BFL_X86 0
#endif

typedef float bfl_f32v __attribute__((vector_size(BFL_VECTOR_BYTES)));
typedef int32_t bfl_i32v __attribute__((vector_size(BFL_VECTOR_BYTES)));
typedef uint32_t bfl_u32v __attribute__((vector_size(BFL_VECTOR_BYTES)));
typedef double bfl_f32sq __attribute__((vector_size(2 * BFL_VECTOR_BYTES))); /* bfl_f32v widened */
typedef double bfl_f64v __attribute__((vector_size(BFL_VECTOR_BYTES)));
typedef int64_t bfl_i64v __attribute__((vector_size(BFL_VECTOR_BYTES)));
typedef uint64_t bfl_u64v __attribute__((vector_size(BFL_VECTOR_BYTES)));

/* Lane shuffles: the butterfly of the lane reductions, and the halves of a widened vector. */
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define BFL_SHUFFLE(X, VI, ...) __builtin_shufflevector((X), (X), __VA_ARGS__)
#if BFL_VECTOR_BYTES == 32
#define BFL_LOW_HALF(X) __builtin_shufflevector((X), (X), 0, 1, 2, 3)
#define BFL_HIGH_HALF(X) __builtin_shufflevector((X), (X), 4, 5, 6, 7)
#else
#define BFL_LOW_HALF(X) __builtin_shufflevector((X), (X), 0, 1)
#define BFL_HIGH_HALF(X) __builtin_shufflevector((X), (X), 2, 3)
#endif
#else /* GCC before 12 */
#define BFL_SHUFFLE(X, VI, ...) __builtin_shuffle((X), (VI){__VA_ARGS__})
static inline bfl_f64v bfl_half(const bfl_f32sq *x, int high) {
    bfl_f64v half;
    memcpy(&half, (const char *)x + (high ? sizeof half : 0), sizeof half);
    return half;
}
#define BFL_LOW_HALF(X) bfl_half(&(X), 0)
#define BFL_HIGH_HALF(X) bfl_half(&(X), 1)
#endif

/* Lane-wise select (MASK lanes -1 or 0, from a vector compare), max and min, by bitwise blend. */
#define BFL_SELECT(MASK, A, B) (((A) & (MASK)) | ((B) & ~(MASK)))
#define BFL_MIN(VI, A, B) BFL_SELECT((VI)((A) < (B)), (A), (B))
#define BFL_ADD(VI, A, B) ((A) + (B))
#define BFL_MAX_f32(VI, A, B) BFL_SELECT(BFL_ABOVE_f32(A, B), (A), (B))
#define BFL_MAX_f64(VI, A, B) BFL_SELECT(BFL_ABOVE_f64(A, B), (A), (B))
/* Combine the lanes of X with OP as a butterfly: every lane ends up with the result. */
#define BFL_FOLD8(VI, X, OP)                                                                 \
    do {                                                                                     \
        X = OP(VI, X, BFL_SHUFFLE(X, VI, 4, 5, 6, 7, 0, 1, 2, 3));                           \
        X = OP(VI, X, BFL_SHUFFLE(X, VI, 2, 3, 0, 1, 6, 7, 4, 5));                           \
        X = OP(VI, X, BFL_SHUFFLE(X, VI, 1, 0, 3, 2, 5, 4, 7, 6));                           \
    } while (0)
#define BFL_FOLD4(VI, X, OP)                                                                 \
    do {                                                                                     \
        X = OP(VI, X, BFL_SHUFFLE(X, VI, 2, 3, 0, 1));                                       \
        X = OP(VI, X, BFL_SHUFFLE(X, VI, 1, 0, 3, 2));                                       \
    } while (0)
#define BFL_FOLD2(VI, X, OP) X = OP(VI, X, BFL_SHUFFLE(X, VI, 1, 0))

/* Per dtype: lanes, lane reduction, bit-pattern compares (-1/0 lanes), the squares, and
 * BFL_RAISE: X = max(X, Y) lane-wise, given HIGHER = BFL_ABOVE(Y, X). */
#if BFL_VECTOR_BYTES == 32
#define BFL_LANES_f32 8
#define BFL_FOLD_f32 BFL_FOLD8
#define BFL_LANES_f64 4
#define BFL_FOLD_f64 BFL_FOLD4
#else
#define BFL_LANES_f32 4
#define BFL_FOLD_f32 BFL_FOLD4
#define BFL_LANES_f64 2
#define BFL_FOLD_f64 BFL_FOLD2
#endif
#define BFL_ABOVE_f32(A, B) ((bfl_i32v)((A) > (B)))
#define BFL_SAME_f32(A, B) ((bfl_i32v)((A) == (B)))
#if BFL_X86 && !defined(__SSE4_2__)
#define BFL_ABOVE_f64(A, B) ((bfl_i64v)((bfl_f64v)(A) > (bfl_f64v)(B)))
#define BFL_SAME_f64(A, B) ((bfl_i64v)((bfl_f64v)(A) == (bfl_f64v)(B)))
#else
#define BFL_ABOVE_f64(A, B) ((bfl_i64v)((A) > (B)))
#define BFL_SAME_f64(A, B) ((bfl_i64v)((A) == (B)))
#endif
#if BFL_X86 && !defined(__SSE4_1__)
#define BFL_RAISE_f32(X, Y, HIGHER) X = BFL_SELECT(HIGHER, Y, X)
#else /* a loop over the lanes, which the compiler makes one vector max instruction */
#define BFL_RAISE_f32(X, Y, HIGHER)                                                          \
    for (int l_ = 0; l_ < BFL_LANES_f32; ++l_) X[l_] = Y[l_] > X[l_] ? Y[l_] : X[l_]
#endif
#define BFL_RAISE_f64(X, Y, HIGHER) X = BFL_SELECT(HIGHER, Y, X)
/* Squares in double: of vector V, or of two vectors V and U, added to LOW and HIGH. */
#define BFL_WIDEN_f32(V, LOW, HIGH)                                                          \
    const bfl_f32sq V##_wide_ = __builtin_convertvector((V), bfl_f32sq);                     \
    const bfl_f64v LOW = BFL_LOW_HALF(V##_wide_), HIGH = BFL_HIGH_HALF(V##_wide_)
#define BFL_SQUARES_f32(V, LOW, HIGH)                                                        \
    do {                                                                                     \
        BFL_WIDEN_f32(V, low_, high_);                                                       \
        LOW += low_ * low_;                                                                  \
        HIGH += high_ * high_;                                                               \
    } while (0)
#define BFL_SQUARES2_f32(V, U, LOW, HIGH)                                                    \
    do {                                                                                     \
        BFL_WIDEN_f32(V, low_v_, high_v_);                                                   \
        BFL_WIDEN_f32(U, low_u_, high_u_);                                                   \
        LOW += low_v_ * low_v_ + low_u_ * low_u_;                                            \
        HIGH += high_v_ * high_v_ + high_u_ * high_u_;                                       \
    } while (0)
#define BFL_SQUARES_f64(V, LOW, HIGH) LOW += (V) * (V)
#define BFL_SQUARES2_f64(V, U, LOW, HIGH) (LOW += (V) * (V), HIGH += (U) * (U))

/* Absorb the bit patterns of vector V (the entries at POSITION) into lane set S of the row:
 * its maximum and first position, and the negativity test. */
#define BFL_ABSORB(SUFFIX, VI, VU, S, V, POSITION)                                           \
    do {                                                                                     \
        const VI bits_ = (VI)(V);                                                            \
        const VI higher_ = BFL_ABOVE_##SUFFIX(bits_, max_##S);                               \
        if (want_argmax) first_##S = BFL_SELECT(higher_, (POSITION), first_##S);             \
        BFL_RAISE_##SUFFIX(max_##S, bits_, higher_);                                         \
        negative |= (VI)((VU)bits_ & ~((VU)bits_ + magnitude)); /* sign bit: negative */     \
    } while (0)

/* The block sweep for one dtype: T the element, BITS its bit pattern, VT / VI / VU vectors of
 * them (VU unsigned). WANT_* are compile-time constants at each call site (see the dispatch in
 * block_portable_*). */
#define DEFINE_PORTABLE_BLOCK(SUFFIX, T, BITS, BITS_MIN, BITS_MAX, VT, VI, VU)               \
    static inline __attribute__((always_inline)) int block_portable_impl_##SUFFIX(           \
        const T *probs, const int64_t *labels, int64_t row0, int64_t row1, int64_t k,        \
        T tolerance, T *top, T *label_prob, uint8_t *correct, double *squares,               \
        const T *edges, int64_t nb, int64_t *bin_count, double *bin_confidence,              \
        int64_t *bin_correct, const int want_squares, const int want_argmax) {               \
        enum { W = BFL_LANES_##SUFFIX };                                                     \
        const int64_t ahead = PREFETCH_BYTES / (int64_t)sizeof(T);                           \
        const int64_t line = CACHE_LINE / (int64_t)sizeof(T);                                \
        const int64_t tail = k % W;     /* past the last whole vector (all if k < W) */      \
        const int64_t whole = k - tail; /* in whole vectors */                               \
        VI iota;                                                                             \
        for (int l = 0; l < W; ++l) iota[l] = (BITS)l;                                       \
        const VI lowest = (VI){0} + (BITS)(BITS_MIN); /* -0.0 */                             \
        const VI none = (VI){0} + (BITS)(BITS_MAX);                                          \
        /* the tail vector holds the row's last W entries: its last `tail` lanes are new */  \
        const VI fresh = (VI)(iota >= (VI){0} + (BITS)(W - tail));                           \
        const VI tail_position = iota + (BITS)(k - W);                                       \
        const VU magnitude = (VU){0} + (BITS_MAX); /* all bits but the sign */               \
        VI negative = {0}; /* a lane's sign bit: it saw a negative entry */                  \
        bfl_f64v squares_low = {0}, squares_high = {0};                                      \
        int ok = 1;                                                                          \
        for (int64_t i = row0; i < row1; ++i) {                                              \
            const T *r = probs + i * k;                                                      \
            for (int64_t c = 0; c < k; c += line) __builtin_prefetch(r + ahead + c);         \
            VI max_a = lowest, max_b = lowest, first_a = {0}, first_b = {0};                 \
            VT sum = {0};                                                                    \
            VI position = iota;                                                              \
            int64_t j = 0;                                                                   \
            for (; j + 2 * W <= k; j += 2 * W) {                                             \
                VT v, w;                                                                     \
                memcpy(&v, r + j, sizeof v);                                                 \
                memcpy(&w, r + j + W, sizeof w);                                             \
                BFL_ABSORB(SUFFIX, VI, VU, a, v, position);                                  \
                BFL_ABSORB(SUFFIX, VI, VU, b, w, position + (BITS)W);                        \
                sum += v + w;                                                                \
                if (want_squares) BFL_SQUARES2_##SUFFIX(v, w, squares_low, squares_high);    \
                position += (BITS)(2 * W);                                                   \
            }                                                                                \
            if (j < whole) {                                                                 \
                VT v;                                                                        \
                memcpy(&v, r + j, sizeof v);                                                 \
                BFL_ABSORB(SUFFIX, VI, VU, a, v, position);                                  \
                sum += v;                                                                    \
                if (want_squares) BFL_SQUARES_##SUFFIX(v, squares_low, squares_high);        \
            }                                                                                \
            if (tail) {                                                                      \
                VT v;                                                                        \
                if ((i + 1) * k >= W) { /* W entries up to the row's end: in the array */    \
                    memcpy(&v, r + k - W, sizeof v);                                         \
                } else { /* k < W and fewer than W entries so far: copy */                   \
                    T staged[W] = {0};                                                       \
                    memcpy(staged + (W - tail), r, (size_t)tail * sizeof(T));                \
                    memcpy(&v, staged, sizeof v);                                            \
                }                                                                            \
                v = (VT)BFL_SELECT(fresh, (VI)v, lowest);                                    \
                BFL_ABSORB(SUFFIX, VI, VU, b, v, tail_position);                             \
                sum += v;                                                                    \
                if (want_squares) BFL_SQUARES_##SUFFIX(v, squares_low, squares_high);        \
            }                                                                                \
            VI top_bits = BFL_MAX_##SUFFIX(VI, max_a, max_b);                                \
            BFL_FOLD_##SUFFIX(VI, top_bits, BFL_MAX_##SUFFIX);                               \
            BFL_FOLD_##SUFFIX(VI, sum, BFL_ADD);                                             \
            int64_t first = 0;                                                               \
            if (want_argmax) { /* the smallest position among lanes holding the maximum */   \
                VI at_a = BFL_SELECT(BFL_SAME_##SUFFIX(max_a, top_bits), first_a, none);     \
                VI at_b = BFL_SELECT(BFL_SAME_##SUFFIX(max_b, top_bits), first_b, none);     \
                VI at = BFL_MIN(VI, at_a, at_b);                                             \
                BFL_FOLD_##SUFFIX(VI, at, BFL_MIN);                                          \
                first = (int64_t)at[0];                                                      \
            }                                                                                \
            ok &= finish_row_##SUFFIX(r, i, first, top_bits[0], sum[0], tolerance, labels,   \
                                      top, label_prob, correct, edges, nb, bin_count,        \
                                      bin_confidence, bin_correct);                          \
        }                                                                                    \
        if (squares) {                                                                       \
            const bfl_f64v total = squares_low + squares_high;                               \
            double square_total = 0.0;                                                       \
            for (size_t l = 0; l < sizeof total / sizeof total[0]; ++l)                      \
                square_total += total[l];                                                    \
            *squares = square_total;                                                         \
        }                                                                                    \
        int any_negative = 0;                                                                \
        for (int l = 0; l < W; ++l) any_negative |= negative[l] < 0;                         \
        return ok && !any_negative;                                                          \
    }                                                                                        \
    static __attribute__((unused)) int block_portable_##SUFFIX(                              \
        const T *probs, const int64_t *labels, int64_t row0, int64_t row1, int64_t k,        \
        T tolerance, T *top, T *label_prob, uint8_t *correct, double *squares,               \
        const T *edges, int64_t nb, int64_t *bin_count, double *bin_confidence,              \
        int64_t *bin_correct) {                                                              \
        const int argmax = correct || edges;                                                 \
        if (squares)                                                                         \
            return argmax ? BFL_RUN_BLOCK(SUFFIX, 1, 1) : BFL_RUN_BLOCK(SUFFIX, 1, 0);       \
        return argmax ? BFL_RUN_BLOCK(SUFFIX, 0, 1) : BFL_RUN_BLOCK(SUFFIX, 0, 0);           \
    }
#define BFL_RUN_BLOCK(SUFFIX, SQUARES, ARGMAX)                                               \
    block_portable_impl_##SUFFIX(probs, labels, row0, row1, k, tolerance, top, label_prob,   \
                                 correct, squares, edges, nb, bin_count, bin_confidence,     \
                                 bin_correct, SQUARES, ARGMAX)
DEFINE_PORTABLE_BLOCK(f32, float, int32_t, INT32_MIN, INT32_MAX, bfl_f32v, bfl_i32v, bfl_u32v)
DEFINE_PORTABLE_BLOCK(f64, double, int64_t, INT64_MIN, INT64_MAX, bfl_f64v, bfl_i64v, bfl_u64v)

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
 * halve the dependency chains. The negativity test and the squares are carried across rows; per
 * row only the maximum, the sum and (if wanted) the argmax are reduced across lanes, without a
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
    /* An entry is negative when its bit pattern, unsigned, exceeds that of -0.0: the sign bit
     * and something more. Bits, not a float compare, so a denormals-are-zero mode (which
     * torch.set_flush_denormal turns on) cannot hide a negative subnormal. */
    const __m512i negative_zero = _mm512_set1_epi32(INT32_MIN);
    __mmask16 negative = 0;
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
            negative |= _mm512_cmpgt_epu32_mask(_mm512_castps_si512(v), negative_zero)
                      | _mm512_cmpgt_epu32_mask(_mm512_castps_si512(w), negative_zero);
            if (want_squares) {
                add_squares(v, &sq_low, &sq_high);
                add_squares(w, &sq_low, &sq_high);
            }
            position = _mm512_add_epi32(position, step32);
        }
        for (; j < full; j += 16) {
            __m512 v = _mm512_loadu_ps(r + j);
            lanes_absorb(&a, v, position, 0xFFFF, want_argmax);
            negative |= _mm512_cmpgt_epu32_mask(_mm512_castps_si512(v), negative_zero);
            if (want_squares) add_squares(v, &sq_low, &sq_high);
            position = _mm512_add_epi32(position, step16);
        }
        if (tail) {  /* masked-off lanes load as 0.0 and are kept out of the maximum */
            __m512 v = _mm512_maskz_loadu_ps(tail, r + j);
            lanes_absorb(&b, v, position, tail, want_argmax);
            negative |= _mm512_cmpgt_epu32_mask(_mm512_castps_si512(v), negative_zero);
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
    return ok && !negative;
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
