/* Native CPU kernels: matmuls of int8 activations x 4- or 8-bit block-quantised weights (W4A8, W8A8),
 * a per-token W8A8 matmul for weights with a scale per output channel (on AMX tiles where the CPU has
 * them), and one decode step of a layer's attention and of a whole decoder layer (further down).
 *
 * The arithmetic is llama.cpp's Q4_1 x Q8_1 and Q8_0 x Q8_0 (ggml-cpu): every row of activations
 * is quantised per block of 32 to int8, xd = amax / 127, xq = round(x / xd) (ties to even),
 * xs = xd * sum(xq), and for weights w = d * c + m in blocks of 32 along K
 *
 *     y[r, n] = sum_b (d[n, b] * xd[r, b]) * sum_j c[n, 32b + j] * xq[r, 32b + j]  +  m[n, b] * xs[r, b]
 *
 * (4-bit: c in 0..15, d and m fp16; 8-bit: c in -127..127, m = 0, d fp16). The integer dot products
 * run on AVX-512 VNNI, else AVX2, else plain C, chosen at run time from CPUID (qmm_isa, and
 * qmm_set_isa to force a lower path), so one build runs on any x86-64 CPU, and the plain C path
 * anywhere else. engine/quant/native.py packs the weights and calls this through ctypes;
 * engine/quant/formats.py holds the torch reference the tests compare every path against.
 *
 * Layouts:
 * - K is padded to Kp, a multiple of 64 (two blocks); padded weight blocks have d = m = 0.
 * - 4-bit codes [N, Kp / 2] bytes: each 64 codes (two blocks) in 32 bytes, byte j = c[j] | c[32 + j] << 4,
 *   so one 32-byte load splits into the first block (low nibbles) and the second (high), both in order.
 * - 8-bit codes [N, Kp] int8 in order. d, m: fp16 [N, Kp / 32].
 * Threads: OpenMP over output columns, at most `threads` (torch's count; torch's wheel ships the same
 * libgomp soname, so one OpenMP runtime serves both).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#define QMM_X86 1
#include <cpuid.h>
#include <immintrin.h>
#define TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#define TARGET_AMX __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#endif
#ifdef __linux__
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define QK 32
#define QMM_MAX_K 65536
#define QMM_MAX_NB (QMM_MAX_K / QK)

enum { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512_VNNI = 2, ISA_AMX = 3 }; /* AMX: VNNI, and AMX-INT8 tiles for qmm_linear_channel */
enum { QMM_OK = 0, QMM_BAD_BITS = 1, QMM_BAD_SHAPE = 2, QMM_NO_MINS = 3, QMM_NO_MEMORY = 4 };

typedef struct {
    const int8_t *xq;   /* [M, Kp] */
    const float *xd;    /* [M, nb] */
    const float *xs;    /* [M, nb] */
    const float *xde;   /* AVX-512 only: [M, nb / 2, 2, 16]: per pair of blocks, xd over each block's 8 lanes,
                         * then xd times each lane's sum of 4 codes (so the mins' term is one FMA a pair) */
    int64_t M, Kp, nb;
    const uint8_t *codes;
    const uint16_t *d, *m;
    int bits;
    const float *bias;
    float *y;           /* [M, ldy] */
    int64_t ldy;
} Job;

/* ------------------------------------------------------------------ CPU features */

/* Linux hands a process the AMX tile state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM for
 * XFEATURE_XTILEDATA); once granted it holds for every thread. */
static int amx_permitted(void) {
#if defined(__linux__) && defined(SYS_arch_prctl)
    static int granted = -1;
    if (granted < 0) granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
    return granted;
#else
    return 0;
#endif
}

static int detected_isa(void) {
#ifdef QMM_X86
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return ISA_SCALAR;
    const int fma = (c >> 12) & 1, osxsave = (c >> 27) & 1, avx = (c >> 28) & 1, f16c = (c >> 29) & 1;
    if (!(osxsave && avx && fma && f16c)) return ISA_SCALAR;
    unsigned xcr0_lo, xcr0_hi;
    __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
    (void)xcr0_hi;
    if ((xcr0_lo & 0x6) != 0x6) return ISA_SCALAR; /* the OS saves SSE and AVX state */
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return ISA_SCALAR;
    const int avx2 = (b >> 5) & 1, avx512f = (b >> 16) & 1, avx512bw = (b >> 30) & 1, avx512vl = (b >> 31) & 1;
    const int vnni = (c >> 11) & 1;
    const int amx_tile = (d >> 24) & 1, amx_int8 = (d >> 25) & 1;
    if (avx512f && avx512bw && avx512vl && vnni && (xcr0_lo & 0xE0) == 0xE0)
        return amx_tile && amx_int8 && (xcr0_lo & 0x60000) == 0x60000 && amx_permitted() ? ISA_AMX : ISA_AVX512_VNNI;
    if (avx2) return ISA_AVX2;
#endif
    return ISA_SCALAR;
}

static int g_isa = -1;

static int current_isa(void) {
    if (g_isa < 0) g_isa = detected_isa();
    return g_isa;
}

/* The path in use: 0 plain C, 1 AVX2, 2 AVX-512 VNNI, 3 the same with AMX-INT8. */
int qmm_isa(void) { return current_isa(); }

/* The best path this CPU has. */
int qmm_detected_isa(void) { return detected_isa(); }

/* Use path `isa` from now on (tests run every path a CPU has); -1 when this CPU lacks it. */
int qmm_set_isa(int isa) {
    if (isa < ISA_SCALAR || isa > detected_isa()) return -1;
    g_isa = isa;
    return isa;
}

/* ------------------------------------------------------------------ helpers */

static float fp16_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, expo = (h >> 10) & 0x1F, man = h & 0x3FF;
    uint32_t bits;
    if (expo == 0) {
        const float f = ldexpf((float)man, -24); /* zero or subnormal */
        memcpy(&bits, &f, 4);
        bits |= sign;
    } else if (expo == 31) {
        bits = sign | 0x7F800000u | (man << 13);
    } else {
        bits = sign | ((expo + 112) << 23) | (man << 13);
    }
    float out;
    memcpy(&out, &bits, 4);
    return out;
}

enum { SCRATCH_KERNEL = 0, SCRATCH_LAYER = 1 }; /* a kernel's own buffer; a decoder layer's activations */
static __thread uint8_t *tl_buffer[2];
static __thread size_t tl_capacity[2];

/* A 64-byte aligned buffer of at least `bytes`, owned by the calling thread and reused across calls. */
static void *scratch(int slot, size_t bytes) {
    bytes = (bytes + 63) & ~(size_t)63;
    if (bytes > tl_capacity[slot]) {
        free(tl_buffer[slot]);
        tl_buffer[slot] = aligned_alloc(64, bytes);
        tl_capacity[slot] = tl_buffer[slot] ? bytes : 0;
    }
    return tl_buffer[slot];
}

/* ------------------------------------------------------------------ plain C */

static void quantize_scalar(const float *x, int64_t M, int64_t K, int64_t ldx, int64_t Kp,
                            int8_t *xq, float *xd, float *xs) {
    const int64_t nb = Kp / QK;
    for (int64_t r = 0; r < M; r++) {
        const float *row = x + r * ldx;
        for (int64_t b = 0; b < nb; b++) {
            float v[QK], amax = 0.f;
            for (int j = 0; j < QK; j++) {
                const int64_t k = b * QK + j;
                v[j] = k < K ? row[k] : 0.f;
                const float a = fabsf(v[j]);
                if (a > amax) amax = a;
            }
            const float scale = amax / 127.f, inv = amax > 0.f ? 1.f / scale : 0.f;
            int sum = 0;
            for (int j = 0; j < QK; j++) {
                const int q = (int)nearbyintf(v[j] * inv);
                xq[r * Kp + b * QK + j] = (int8_t)q;
                sum += q;
            }
            xd[r * nb + b] = scale;
            xs[r * nb + b] = scale * (float)sum;
        }
    }
}

static void gemm_scalar(const Job *J, int64_t n0, int64_t n1) {
    const int64_t Kp = J->Kp, nb = J->nb, row_bytes = J->bits == 4 ? Kp / 2 : Kp;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *wc = J->codes + n * row_bytes;
        const uint16_t *wd = J->d + n * nb, *wm = J->m ? J->m + n * nb : NULL;
        for (int64_t r = 0; r < J->M; r++) {
            const int8_t *xq = J->xq + r * Kp;
            float acc = 0.f;
            for (int64_t b = 0; b < nb; b++) {
                int32_t s = 0;
                if (J->bits == 4) {
                    const uint8_t *pair = wc + (b / 2) * 32;
                    const int high = (int)(b & 1);
                    for (int j = 0; j < QK; j++) s += (high ? pair[j] >> 4 : pair[j] & 0x0F) * xq[b * QK + j];
                } else {
                    for (int j = 0; j < QK; j++) s += (int8_t)wc[b * QK + j] * xq[b * QK + j];
                }
                acc += fp16_to_float(wd[b]) * J->xd[r * nb + b] * (float)s;
                if (wm) acc += fp16_to_float(wm[b]) * J->xs[r * nb + b];
            }
            J->y[r * J->ldy + n] = acc + (J->bias ? J->bias[n] : 0.f);
        }
    }
}

/* ------------------------------------------------------------------ AVX2 */
#ifdef QMM_X86

TARGET_AVX2 static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

TARGET_AVX2 static void quantize_avx2(const float *x, int64_t M, int64_t K, int64_t ldx, int64_t Kp,
                                      int8_t *xq, float *xd, float *xs) {
    const int64_t nb = Kp / QK;
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (int64_t r = 0; r < M; r++) {
        const float *row = x + r * ldx;
        for (int64_t b = 0; b < nb; b++) {
            __m256 v[4];
            if ((b + 1) * QK <= K) {
                for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(row + b * QK + 8 * i);
            } else {
                float tmp[QK];
                for (int j = 0; j < QK; j++) tmp[j] = b * QK + j < K ? row[b * QK + j] : 0.f;
                for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(tmp + 8 * i);
            }
            __m256 a = _mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask));
            a = _mm256_max_ps(a, _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask)));
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            h = _mm_max_ss(h, _mm_movehdup_ps(h));
            const float amax = _mm_cvtss_f32(h);
            const float scale = amax / 127.f, inv = amax > 0.f ? 1.f / scale : 0.f;
            const __m256 vinv = _mm256_set1_ps(inv);
            __m256i sum = _mm256_setzero_si256();
            int32_t q[QK];
            for (int i = 0; i < 4; i++) {
                const __m256i qi = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], vinv)); /* rounds to nearest even */
                sum = _mm256_add_epi32(sum, qi);
                _mm256_storeu_si256((__m256i *)(q + 8 * i), qi);
            }
            for (int j = 0; j < QK; j++) xq[r * Kp + b * QK + j] = (int8_t)q[j];
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
            xd[r * nb + b] = scale;
            xs[r * nb + b] = scale * (float)_mm_cvtsi128_si32(s4);
        }
    }
}

/* sum over blocks of a fp16 row (d or m) times xs: the mins' term of one output. */
TARGET_AVX2 static float fp16_dot_avx2(const uint16_t *h, const float *v, int64_t nb) {
    __m256 acc = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8)
        acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + b))), _mm256_loadu_ps(v + b), acc);
    float out = hsum256(acc);
    for (; b < nb; b++) out += fp16_to_float(h[b]) * v[b];
    return out;
}

#define TILE 4

TARGET_AVX2 static void gemm_avx2(const Job *J, int64_t n0, int64_t n1) {
    const int64_t Kp = J->Kp, nb = J->nb, row_bytes = J->bits == 4 ? Kp / 2 : Kp;
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    const __m256i ones = _mm256_set1_epi16(1);
    float dw[QMM_MAX_NB];
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *wc = J->codes + n * row_bytes;
        const uint16_t *wd = J->d + n * nb;
        for (int64_t b = 0; b < nb; b++) dw[b] = fp16_to_float(wd[b]);
        for (int64_t r0 = 0; r0 < J->M; r0 += TILE) {
            const int R = J->M - r0 < TILE ? (int)(J->M - r0) : TILE;
            __m256 acc[TILE];
            for (int i = 0; i < TILE; i++) acc[i] = _mm256_setzero_ps();
            for (int64_t b = 0; b < nb; b += 2) {
                __m256i c0, c1;
                if (J->bits == 4) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(wc + b * 16));
                    c0 = _mm256_and_si256(v, nibble);
                    c1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
                } else {
                    c0 = _mm256_loadu_si256((const __m256i *)(wc + b * QK));
                    c1 = _mm256_loadu_si256((const __m256i *)(wc + b * QK + QK));
                }
                for (int i = 0; i < R; i++) {
                    const int64_t r = r0 + i;
                    const int8_t *xr = J->xq + r * Kp + b * QK;
                    const __m256i x0 = _mm256_loadu_si256((const __m256i *)xr);
                    const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xr + QK));
                    __m256i s0, s1;
                    if (J->bits == 4) { /* codes 0..15 unsigned x int8: pair sums fit int16 */
                        s0 = _mm256_madd_epi16(_mm256_maddubs_epi16(c0, x0), ones);
                        s1 = _mm256_madd_epi16(_mm256_maddubs_epi16(c1, x1), ones);
                    } else { /* int8 x int8: |x| unsigned times w with x's sign, as ggml does */
                        s0 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(x0, x0), _mm256_sign_epi8(c0, x0)), ones);
                        s1 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(x1, x1), _mm256_sign_epi8(c1, x1)), ones);
                    }
                    const float *xd = J->xd + r * nb + b;
                    acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_set1_ps(dw[b] * xd[0]), acc[i]);
                    acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_set1_ps(dw[b + 1] * xd[1]), acc[i]);
                }
            }
            for (int i = 0; i < R; i++) {
                const int64_t r = r0 + i;
                float out = hsum256(acc[i]);
                if (J->m) out += fp16_dot_avx2(J->m + n * nb, J->xs + r * nb, nb);
                J->y[r * J->ldy + n] = out + (J->bias ? J->bias[n] : 0.f);
            }
        }
    }
}

/* ------------------------------------------------------------------ AVX-512 VNNI */

TARGET_AVX512 static void quantize_avx512(const float *x, int64_t M, int64_t K, int64_t ldx, int64_t Kp,
                                          int8_t *xq, float *xd, float *xs, float *xde) {
    const int64_t nb = Kp / QK;
    const __m512i pair_lanes = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512i ones = _mm512_set1_epi8(1);
    for (int64_t r = 0; r < M; r++) {
        const float *row = x + r * ldx;
        for (int64_t b = 0; b < nb; b++) {
            const int64_t k0 = b * QK;
            const int64_t left0 = K - k0, left1 = K - k0 - 16;
            const __mmask16 m0 = left0 >= 16 ? 0xFFFF : left0 <= 0 ? 0 : (__mmask16)((1u << left0) - 1);
            const __mmask16 m1 = left1 >= 16 ? 0xFFFF : left1 <= 0 ? 0 : (__mmask16)((1u << left1) - 1);
            const __m512 v0 = _mm512_maskz_loadu_ps(m0, row + k0);
            const __m512 v1 = _mm512_maskz_loadu_ps(m1, row + k0 + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
            const float scale = amax / 127.f, inv = amax > 0.f ? 1.f / scale : 0.f;
            const __m512 vinv = _mm512_set1_ps(inv);
            const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, vinv)); /* rounds to nearest even */
            const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, vinv));
            _mm_storeu_si128((__m128i *)(xq + r * Kp + k0), _mm512_cvtsepi32_epi8(q0));
            _mm_storeu_si128((__m128i *)(xq + r * Kp + k0 + 16), _mm512_cvtsepi32_epi8(q1));
            xd[r * nb + b] = scale;
            xs[r * nb + b] = scale * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        }
        for (int64_t p = 0; p < nb / 2; p++) { /* per pair: xd over each block's 8 lanes, then xd x the lanes' sums of xq */
            const __m512 scale = _mm512_permutexvar_ps(pair_lanes, _mm512_maskz_loadu_ps(0x3, xd + r * nb + 2 * p));
            const __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, _mm512_loadu_si512((const void *)(xq + r * Kp + p * 64)));
            _mm512_storeu_ps(xde + (r * (nb / 2) + p) * 32, scale);
            _mm512_storeu_ps(xde + (r * (nb / 2) + p) * 32 + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(sums), scale));
        }
    }
}

/* Weight rows ahead of the tile in hand whose codes are prefetched: the weights stream from memory once
 * a step, and the hardware prefetcher alone left the 8-bit LM head at a third of the memory bandwidth. */
#define PREFETCH_ROWS 8

/* One tile: weight rows n0 .. n0 + NR times activation rows r0 .. r0 + MR, NR and MR constants where
 * it is inlined (1..4), so that its NR x MR accumulators stay in registers and each decoded weight
 * vector serves MR rows, each activation vector NR weight rows. */
TARGET_AVX512 static inline __attribute__((always_inline)) void tile_avx512(const Job *J, int64_t n0, const int NR,
                                                                            int64_t r0, const int MR) {
    const int64_t Kp = J->Kp, nb = J->nb, np = nb / 2, row_bytes = J->bits == 4 ? Kp / 2 : Kp;
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const __m512i pair_lanes = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512 minus128 = _mm512_set1_ps(-128.f);
    __m512 acc[4][4];
    for (int a = 0; a < NR; a++)
        for (int b = 0; b < MR; b++) acc[a][b] = _mm512_setzero_ps();
    for (int64_t p = 0; p < np; p++) {
        __m512i c[4];
        __m512 dwp[4], mwp[4]; /* d and m of the pair over 8 lanes each (8-bit: m = -128 d, undoing the offset) */
        for (int a = 0; a < NR; a++) {
            const uint8_t *wc = J->codes + (n0 + a) * row_bytes;
            _mm_prefetch((const char *)(wc + PREFETCH_ROWS * row_bytes + p * (J->bits == 4 ? 32 : 64)), _MM_HINT_T0);
            if (J->bits == 4) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(wc + p * 32));
                c[a] = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1), nibble);
            } else { /* int8 + 128 as unsigned: the -128 * sum(xq) this adds is taken off with the mins' term */
                c[a] = _mm512_xor_si512(_mm512_loadu_si512((const void *)(wc + p * 64)), flip);
            }
            int32_t two_halves;
            memcpy(&two_halves, J->d + (n0 + a) * nb + 2 * p, 4);
            dwp[a] = _mm512_permutexvar_ps(pair_lanes, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128(two_halves))));
            if (J->m) {
                memcpy(&two_halves, J->m + (n0 + a) * nb + 2 * p, 4);
                mwp[a] = _mm512_permutexvar_ps(pair_lanes, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128(two_halves))));
            } else {
                mwp[a] = _mm512_mul_ps(dwp[a], minus128);
            }
        }
        for (int b = 0; b < MR; b++) {
            const __m512i x = _mm512_loadu_si512((const void *)(J->xq + (r0 + b) * Kp + p * 64));
            const float *e = J->xde + ((r0 + b) * np + p) * 32;
            const __m512 xd = _mm512_loadu_ps(e), xs = _mm512_loadu_ps(e + 16);
            for (int a = 0; a < NR; a++) {
                const __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c[a], x);
                acc[a][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dwp[a], xd), acc[a][b]);
                acc[a][b] = _mm512_fmadd_ps(mwp[a], xs, acc[a][b]);
            }
        }
    }
    for (int a = 0; a < NR; a++) {
        const int64_t n = n0 + a;
        for (int b = 0; b < MR; b++) {
            const int64_t r = r0 + b;
            J->y[r * J->ldy + n] = _mm512_reduce_add_ps(acc[a][b]) + (J->bias ? J->bias[n] : 0.f);
        }
    }
}

/* Activation rows in tiles of 4, then the 1-3 left: TILE(J, col, NC, r0, MR) with NC and MR constants,
 * so that each tile's accumulators stay in registers. */
#define ROWS_IN_TILES(TILE, col, NC)                                               \
    do {                                                                           \
        int64_t r0 = 0;                                                            \
        for (; r0 + 4 <= J->M; r0 += 4) TILE(J, col, NC, r0, 4);                   \
        switch (J->M - r0) {                                                       \
        case 3: TILE(J, col, NC, r0, 3); break;                                    \
        case 2: TILE(J, col, NC, r0, 2); break;                                    \
        case 1: TILE(J, col, NC, r0, 1); break;                                    \
        default: break;                                                            \
        }                                                                          \
    } while (0)

TARGET_AVX512 static void gemm_avx512(const Job *J, int64_t n0, int64_t n1) {
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) ROWS_IN_TILES(tile_avx512, n, 4);
    for (; n < n1; n++) ROWS_IN_TILES(tile_avx512, n, 1);
}

#endif /* QMM_X86 */

/* ------------------------------------------------------------------ decode attention
 *
 * One decode step of a layer's attention, for sequences that each add one token (row t = sequence t):
 * rotate q and k by the token's angles (HF's rotate-half convention: x * cos + [-x2, x1] * sin), store
 * k and v at the token's slot of the paged fp32 cache [2, num_blocks, block_size, Hkv, D], and attend
 * q over the sequence's cached keys (GQA: query head h reads KV head h / (H / Hkv); a sliding window w
 * keeps the last w). Plain C, compiled once per instruction set (the loops vectorise: the dot products
 * keep 16 independent partial sums, so no reassociation is needed). */

typedef struct {
    const float *qkv;            /* [T, ld_qkv]: q (H * D), k (Hkv * D), v (Hkv * D) */
    int64_t ld_qkv;
    const float *cos, *sin;      /* [T, D] */
    float *cache;                /* [2, num_blocks, block_size, Hkv, D] */
    int64_t num_blocks, block_size;
    const int64_t *slots;        /* [T], -1 = no slot */
    const int32_t *block_tables; /* [T, max_blocks] */
    int64_t max_blocks;
    const int32_t *seq_lens;     /* [T] */
    int64_t H, Hkv, D, window;   /* window <= 0: none */
    float scale;
    float *out;                  /* [T, H * D] */
} Attention;

/* exp(x) to about 1 ulp (Cephes' expf: Cody-Waite reduction by ln 2, degree-6 polynomial), written so
 * that loops over it vectorise, which libm's expf does not. */
static inline __attribute__((always_inline)) float exp_fast(float x) {
    x = x < -87.3f ? -87.3f : x > 88.3f ? 88.3f : x;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

static inline __attribute__((always_inline)) float dot_f32(const float *a, const float *b, int64_t n) {
    float acc[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) acc[j] += a[i + j] * b[i + j];
    float s = 0.f;
    for (int j = 0; j < 16; j++) s += acc[j];
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline __attribute__((always_inline)) void rotate(const float *x, const float *c, const float *s, int64_t D, float *out) {
    const int64_t half = D / 2;
    for (int64_t i = 0; i < half; i++) out[i] = x[i] * c[i] - x[half + i] * s[i];
    for (int64_t i = 0; i < half; i++) out[half + i] = x[half + i] * c[half + i] + x[i] * s[half + i];
}

static inline __attribute__((always_inline)) void decode_token(const Attention *A, int64_t t, float *qr, float *scores) {
    const int64_t H = A->H, Hkv = A->Hkv, D = A->D, bs = A->block_size;
    const float *row = A->qkv + t * A->ld_qkv, *c = A->cos + t * D, *s = A->sin + t * D;
    float *keys = A->cache, *values = A->cache + A->num_blocks * bs * Hkv * D;
    for (int64_t h = 0; h < H; h++) rotate(row + h * D, c, s, D, qr + h * D);
    const int64_t slot = A->slots[t];
    if (slot >= 0) {
        for (int64_t g = 0; g < Hkv; g++) rotate(row + (H + g) * D, c, s, D, keys + (slot * Hkv + g) * D);
        memcpy(values + slot * Hkv * D, row + (H + Hkv) * D, (size_t)(Hkv * D) * sizeof(float));
    }
    const int64_t L = A->seq_lens[t], start = A->window > 0 && L > A->window ? L - A->window : 0;
    if (L <= 0) { /* a padding row (a captured batch size): zeros, as the torch path gives */
        memset(A->out + t * H * D, 0, (size_t)(H * D) * sizeof(float));
        return;
    }
    const int32_t *table = A->block_tables + t * A->max_blocks;
    const int64_t group = H / Hkv;
    for (int64_t h = 0; h < H; h++) {
        const int64_t kv_head = h / group;
        const float *q = qr + h * D;
        float top = -INFINITY;
        for (int64_t p = start; p < L; p++) {
            const int64_t at = ((int64_t)table[p / bs] * bs + p % bs) * Hkv + kv_head;
            const float score = dot_f32(q, keys + at * D, D) * A->scale;
            scores[p - start] = score;
            if (score > top) top = score;
        }
        for (int64_t i = 0; i < L - start; i++) scores[i] = exp_fast(scores[i] - top);
        float total = 0.f;
        for (int64_t i = 0; i < L - start; i++) total += scores[i];
        float *o = A->out + t * H * D + h * D;
        for (int64_t i = 0; i < D; i++) o[i] = 0.f;
        for (int64_t p = start; p < L; p++) {
            const int64_t at = ((int64_t)table[p / bs] * bs + p % bs) * Hkv + kv_head;
            const float e = scores[p - start], *v = values + at * D;
            for (int64_t i = 0; i < D; i++) o[i] += e * v[i];
        }
        const float inv = 1.f / total;
        for (int64_t i = 0; i < D; i++) o[i] *= inv;
    }
}

/* Rows [t0, t1) with this thread's scratch (rotated queries, then scores). */
#define DECODE_ROWS(A, t0, t1)                                                                          \
    do {                                                                                                \
        int64_t longest = 1;                                                                            \
        for (int64_t t = (t0); t < (t1); t++) longest = (A)->seq_lens[t] > longest ? (A)->seq_lens[t] : longest; \
        float *buffer = scratch(SCRATCH_KERNEL, (size_t)((A)->H * (A)->D + longest) * sizeof(float));                   \
        if (!buffer) return QMM_NO_MEMORY;                                                              \
        for (int64_t t = (t0); t < (t1); t++) decode_token((A), t, buffer, buffer + (A)->H * (A)->D);   \
        return QMM_OK;                                                                                  \
    } while (0)

static int decode_rows_scalar(const Attention *A, int64_t t0, int64_t t1) { DECODE_ROWS(A, t0, t1); }
#ifdef QMM_X86
TARGET_AVX2 static int decode_rows_avx2(const Attention *A, int64_t t0, int64_t t1) { DECODE_ROWS(A, t0, t1); }
TARGET_AVX512 static int decode_rows_avx512(const Attention *A, int64_t t0, int64_t t1) { DECODE_ROWS(A, t0, t1); }
#endif

static int decode_rows(int isa, const Attention *A, int64_t t0, int64_t t1) {
#ifdef QMM_X86
    if (isa >= ISA_AVX512_VNNI) return decode_rows_avx512(A, t0, t1);
    if (isa == ISA_AVX2) return decode_rows_avx2(A, t0, t1);
#endif
    return decode_rows_scalar(A, t0, t1);
}

static int attention_run(const Attention *A, int64_t T, int threads) {
    const int64_t H = A->H, Hkv = A->Hkv, D = A->D;
    if (T < 0 || H <= 0 || Hkv <= 0 || H % Hkv || D <= 0 || D % 2 || A->ld_qkv < (H + 2 * Hkv) * D || A->block_size <= 0)
        return QMM_BAD_SHAPE;
    for (int64_t t = 0; t < T; t++) {
        const int64_t L = A->seq_lens[t];
        if ((L > 0 && (L - 1) / A->block_size >= A->max_blocks) || A->slots[t] >= A->num_blocks * A->block_size)
            return QMM_BAD_SHAPE;
    }
    const int isa = current_isa();
#ifdef _OPENMP
    if (threads > 1 && T >= 2 * threads) {
        int failed = 0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(| : failed)
        for (int64_t part = 0; part < threads; part++) failed |= decode_rows(isa, A, T * part / threads, T * (part + 1) / threads);
        return failed ? QMM_NO_MEMORY : QMM_OK;
    }
#else
    (void)threads;
#endif
    return decode_rows(isa, A, 0, T);
}

/* One decode step's attention for T sequences (see above); out [T, H * D]. Returns 0 or a QMM_* code. */
int qmm_decode_attention(const float *qkv, int64_t T, int64_t ld_qkv, const float *cos, const float *sin,
                         float *cache, int64_t num_blocks, int64_t block_size, const int64_t *slots,
                         const int32_t *block_tables, int64_t max_blocks, const int32_t *seq_lens, int64_t H,
                         int64_t Hkv, int64_t D, float scale, int64_t window, float *out, int threads) {
    const Attention A = {qkv, ld_qkv, cos, sin, cache, num_blocks, block_size, slots, block_tables, max_blocks,
                         seq_lens, H, Hkv, D, window, scale, out};
    return attention_run(&A, T, threads);
}

/* ------------------------------------------------------------------ entry point */

static void run_gemm(int isa, const Job *J, int64_t n0, int64_t n1) {
#ifdef QMM_X86
    if (isa >= ISA_AVX512_VNNI) { gemm_avx512(J, n0, n1); return; }
    if (isa == ISA_AVX2) { gemm_avx2(J, n0, n1); return; }
#endif
    gemm_scalar(J, n0, n1);
}

/* y[M, N] (row stride ldy) = x[M, K] (row stride ldx) times the block-quantised weight's transpose, plus
 * bias [N] when not NULL. codes / d / m as in the header (m NULL for 8-bit weights); Kp a multiple of 64,
 * at least K and at most QMM_MAX_K. Returns 0, or a QMM_* error code. */
int qmm_linear(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *codes, const uint16_t *d,
               const uint16_t *m, int64_t N, int64_t Kp, int bits, const float *bias, float *y, int64_t ldy,
               int threads) {
    if (bits != 4 && bits != 8) return QMM_BAD_BITS;
    if (Kp % 64 || Kp < K || Kp > QMM_MAX_K || M < 0 || N < 0 || ldx < K || ldy < N) return QMM_BAD_SHAPE;
    if (bits == 4 && !m) return QMM_NO_MINS;
    if (M == 0 || N == 0) return QMM_OK;
    const int isa = current_isa();
    const int64_t nb = Kp / QK;
    const size_t q_bytes = ((size_t)(M * Kp) + 63) & ~(size_t)63, f_bytes = ((size_t)(M * nb) * sizeof(float) + 63) & ~(size_t)63;
    uint8_t *buffer = scratch(SCRATCH_KERNEL, q_bytes + 2 * f_bytes + (size_t)(M * nb) * 16 * sizeof(float)); /* xq, xd, xs, xde */
    if (!buffer) return QMM_NO_MEMORY;
    int8_t *xq = (int8_t *)buffer;
    float *xd = (float *)(buffer + q_bytes), *xs = (float *)(buffer + q_bytes + f_bytes);
    float *xde = (float *)(buffer + q_bytes + 2 * f_bytes);
#ifdef QMM_X86
    if (isa >= ISA_AVX512_VNNI) quantize_avx512(x, M, K, ldx, Kp, xq, xd, xs, xde);
    else if (isa == ISA_AVX2) quantize_avx2(x, M, K, ldx, Kp, xq, xd, xs);
    else
#endif
        quantize_scalar(x, M, K, ldx, Kp, xq, xd, xs);
    const Job job = {xq, xd, xs, xde, M, Kp, nb, codes, d, m, bits, bias, y, ldy};
#ifdef _OPENMP
    if (threads > 1 && N >= 64) {
        const int64_t parts = threads;
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t t = 0; t < parts; t++) run_gemm(isa, &job, N * t / parts, N * (t + 1) / parts);
        return QMM_OK;
    }
#else
    (void)threads;
#endif
    run_gemm(isa, &job, 0, N);
    return QMM_OK;
}

/* ------------------------------------------------------------------ per-channel W8A8
 *
 * int8 weights with one scale per output channel (Int8Linear's own layout: w[n, k] = ws[n] * c[n, k])
 * times activations quantised to int8 per row over the whole of K, after an optional per-column
 * multiplier (SmoothQuant's 1 / smooth): v = x * mul, xd = amax(|v|) / 127, xq = round(v / xd), ties
 * to even, and
 *
 *     y[r, n] = (ws[n] * xd[r]) * sum_k c[n, k] * xq[r, k]  +  bias[n]
 *
 * One integer dot product per output, no float work inside it, where the block kernels above scale
 * every block of 32: per-token W8A8 as fbgemm's linear_dynamic computes it through five torch ops
 * around each call (a division by each row's maximum before, a product after), here in one call and
 * with 8-bit activations where fbgemm keeps 7.
 *
 * Layout (engine/quant/native.py pack_int8_channels): codes int8 [Np / 16, Kp / 4, 16, 4], N padded to
 * Np (a multiple of 16), K to Kp (a multiple of 64), padding c = 0; ws fp32 [N]. Each 64 bytes are 16
 * output channels x 4 consecutive k, VNNI's operand: one instruction multiplies them by 4 activation
 * bytes broadcast to every lane and adds into 16 outputs at once, so no accumulator is ever reduced
 * across lanes. VNNI multiplies unsigned by signed bytes: the codes go in as c + 128 (one XOR as they
 * load) and 128 * sum(xq) comes off at the end; no sum can overflow 32 bits (255 * 127 * 65536 < 2^31).
 * AVX-512 VNNI, else plain C (the reference the tests hold it to, bit for bit: both sum the same
 * integers and round the same products). */

#define CHANNEL_COLS 16 /* output channels per 64-byte group */

typedef struct {
    const int8_t *xq;     /* [M, Kp] */
    const float *xd;      /* [M] */
    const int32_t *xsum;  /* [M]: sum of each row's codes */
    int64_t M, Kp, N;
    const int8_t *codes;  /* [Np / 16, Kp / 4, 16, 4] */
    const float *ws;      /* [N] */
    const float *bias;
    float *y;
    int64_t ldy;
} ChannelJob;

static void quantize_rows_scalar(const float *x, int64_t M, int64_t K, int64_t ldx, const float *mul, int64_t Kp,
                                 int8_t *xq, float *xd, int32_t *xsum) {
    for (int64_t r = 0; r < M; r++) {
        const float *row = x + r * ldx;
        float amax = 0.f;
        for (int64_t k = 0; k < K; k++) {
            const float a = fabsf(mul ? row[k] * mul[k] : row[k]);
            if (a > amax) amax = a;
        }
        const float scale = amax / 127.f, inv = amax > 0.f ? 1.f / scale : 0.f;
        int32_t sum = 0;
        for (int64_t k = 0; k < Kp; k++) {
            const int q = k < K ? (int)nearbyintf((mul ? row[k] * mul[k] : row[k]) * inv) : 0;
            xq[r * Kp + k] = (int8_t)q;
            sum += q;
        }
        xd[r] = scale;
        xsum[r] = sum;
    }
}

/* Output channels of groups g0 .. g1 (16 each). */
static void channel_gemm_scalar(const ChannelJob *J, int64_t g0, int64_t g1) {
    const int64_t quads = J->Kp / 4;
    for (int64_t n = g0 * CHANNEL_COLS; n < g1 * CHANNEL_COLS && n < J->N; n++) {
        const int8_t *group = J->codes + (n / CHANNEL_COLS) * quads * 64 + (n % CHANNEL_COLS) * 4;
        for (int64_t r = 0; r < J->M; r++) {
            int32_t dot = 0;
            for (int64_t k = 0; k < J->Kp; k++) dot += (int32_t)group[(k / 4) * 64 + k % 4] * J->xq[r * J->Kp + k];
            J->y[r * J->ldy + n] = (float)dot * (J->ws[n] * J->xd[r]) + (J->bias ? J->bias[n] : 0.f);
        }
    }
}

#ifdef QMM_X86
TARGET_AVX512 static void quantize_rows_avx512(const float *x, int64_t M, int64_t K, int64_t ldx, const float *mul,
                                               int64_t Kp, int8_t *xq, float *xd, int32_t *xsum) {
    for (int64_t r = 0; r < M; r++) {
        const float *row = x + r * ldx;
        __m512 amax = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += 16) {
            const __mmask16 m = K - k >= 16 ? 0xFFFF : (__mmask16)((1u << (K - k)) - 1);
            __m512 v = _mm512_maskz_loadu_ps(m, row + k);
            if (mul) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, mul + k));
            amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
        }
        const float top = _mm512_reduce_max_ps(amax);
        const float scale = top / 127.f, inv = top > 0.f ? 1.f / scale : 0.f;
        const __m512 vinv = _mm512_set1_ps(inv);
        __m512i sum = _mm512_setzero_si512();
        for (int64_t k = 0; k < Kp; k += 16) {
            const int64_t left = K - k;
            const __mmask16 m = left >= 16 ? 0xFFFF : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
            __m512 v = _mm512_maskz_loadu_ps(m, row + k);
            if (mul) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, mul + k));
            const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v, vinv)); /* rounds to nearest even */
            sum = _mm512_add_epi32(sum, q);
            _mm_storeu_si128((__m128i *)(xq + r * Kp + k), _mm512_cvtsepi32_epi8(q));
        }
        xd[r] = scale;
        xsum[r] = _mm512_reduce_add_epi32(sum);
    }
}

/* Row r's outputs for the 16 channels of group g, from their exact dot products: dot * (ws * xd[r]) + bias,
 * in the plain C path's order of operations (so every path rounds alike). */
TARGET_AVX512 static inline __attribute__((always_inline)) void channel_store_avx512(const ChannelJob *J, int64_t g,
                                                                                     int64_t r, __m512i dot) {
    const int64_t n = g * CHANNEL_COLS;
    const __mmask16 m = J->N - n >= 16 ? 0xFFFF : (__mmask16)((1u << (J->N - n)) - 1);
    const __m512 out = _mm512_mul_ps(_mm512_cvtepi32_ps(dot),
                                     _mm512_mul_ps(_mm512_maskz_loadu_ps(m, J->ws + n), _mm512_set1_ps(J->xd[r])));
    _mm512_mask_storeu_ps(J->y + r * J->ldy + n, m, J->bias ? _mm512_add_ps(out, _mm512_maskz_loadu_ps(m, J->bias + n)) : out);
}

/* Channel groups g0 .. g0 + NG times activation rows r0 .. r0 + MR (NG, MR constants where it is
 * inlined, 1..4): NG x MR vectors of 16 outputs in registers; each group's 64 bytes serve MR rows. */
TARGET_AVX512 static inline __attribute__((always_inline)) void channel_tile_avx512(const ChannelJob *J, int64_t g0,
                                                                                    const int NG, int64_t r0, const int MR) {
    const int64_t Kp = J->Kp, quads = Kp / 4;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512i acc[4][4];
    for (int g = 0; g < NG; g++)
        for (int b = 0; b < MR; b++) acc[g][b] = _mm512_setzero_si512();
    for (int64_t q = 0; q < quads; q++) {
        __m512i c[4];
        for (int g = 0; g < NG; g++) {
            const int8_t *codes = J->codes + ((g0 + g) * quads + q) * 64;
            _mm_prefetch((const char *)(codes + 8 * 64), _MM_HINT_T0);
            c[g] = _mm512_xor_si512(_mm512_loadu_si512((const void *)codes), flip);
        }
        for (int b = 0; b < MR; b++) {
            int32_t four;
            memcpy(&four, J->xq + (r0 + b) * Kp + 4 * q, 4);
            const __m512i x = _mm512_set1_epi32(four);
            for (int g = 0; g < NG; g++) acc[g][b] = _mm512_dpbusd_epi32(acc[g][b], c[g], x);
        }
    }
    for (int g = 0; g < NG; g++)
        for (int b = 0; b < MR; b++)
            channel_store_avx512(J, g0 + g, r0 + b,
                                 _mm512_sub_epi32(acc[g][b], _mm512_set1_epi32((int32_t)(128u * (uint32_t)J->xsum[r0 + b]))));
}

TARGET_AVX512 static void channel_gemm_avx512(const ChannelJob *J, int64_t g0, int64_t g1) {
    int64_t g = g0;
    for (; g + 4 <= g1; g += 4) ROWS_IN_TILES(channel_tile_avx512, g, 4);
    for (; g < g1; g++) ROWS_IN_TILES(channel_tile_avx512, g, 1);
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* AMX-INT8: per 16 rows, four groups of 16 channels at a time in tiles 0-3 (16 x 16 int32 each), 64 k
 * of activations in tile 4 (rows x 64 signed bytes), each group's 16 quads x 64 bytes in tiles 5-7 in
 * turn (the layout's 64-byte rows are AMX's B operand as they are). Signed x signed bytes (TDPBSSD):
 * no offset to take off, and the same integer sums as the other paths. */
#define AMX_GROUP(j, tile)                                                        \
    do {                                                                          \
        if (ng > j) {                                                             \
            _tile_loadd(tile, b + (j) * quads * 64, 64);                          \
            _tile_dpbssd(j, 4, tile);                                             \
        }                                                                         \
    } while (0)

TARGET_AMX static void channel_gemm_amx(const ChannelJob *J, int64_t g0, int64_t g1) {
    const int64_t Kp = J->Kp, quads = Kp / 4;
    int32_t dots[4][16 * 16] __attribute__((aligned(64)));
    for (int64_t r0 = 0; r0 < J->M; r0 += 16) {
        const int rows = J->M - r0 < 16 ? (int)(J->M - r0) : 16;
        TileConfig cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int t = 0; t < 8; t++) {
            cfg.rows[t] = t >= 5 ? 16 : (uint8_t)rows;
            cfg.colsb[t] = 64;
        }
        _tile_loadconfig(&cfg);
        for (int64_t g = g0; g < g1; g += 4) {
            const int ng = g1 - g < 4 ? (int)(g1 - g) : 4;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t k = 0; k < Kp; k += 64) {
                _tile_loadd(4, J->xq + r0 * Kp + k, Kp);
                const int8_t *b = J->codes + (g * quads + k / 4) * 64;
                AMX_GROUP(0, 5);
                AMX_GROUP(1, 6);
                AMX_GROUP(2, 7);
                AMX_GROUP(3, 5);
            }
            _tile_stored(0, dots[0], 64);
            if (ng > 1) _tile_stored(1, dots[1], 64);
            if (ng > 2) _tile_stored(2, dots[2], 64);
            if (ng > 3) _tile_stored(3, dots[3], 64);
            for (int j = 0; j < ng; j++)
                for (int b = 0; b < rows; b++) channel_store_avx512(J, g + j, r0 + b, _mm512_load_si512((const void *)(dots[j] + 16 * b)));
        }
    }
    _tile_release();
}
#endif /* QMM_X86 */

static void run_channel_gemm(int isa, const ChannelJob *J, int64_t g0, int64_t g1) {
#ifdef QMM_X86
    if (isa == ISA_AMX) { channel_gemm_amx(J, g0, g1); return; }
    if (isa >= ISA_AVX512_VNNI) { channel_gemm_avx512(J, g0, g1); return; }
#else
    (void)isa;
#endif
    channel_gemm_scalar(J, g0, g1);
}

/* y[M, N] (row stride ldy) = x[M, K] (row stride ldx), times mul [K] per column when not NULL, times the
 * per-channel int8 weight's transpose, plus bias [N] when not NULL (layouts in the section's header).
 * Returns 0, or a QMM_* error code. Without VNNI it runs plain C: callers pick another kernel there. */
int qmm_linear_channel(const float *x, int64_t M, int64_t K, int64_t ldx, const float *mul, const int8_t *codes,
                       const float *ws, int64_t N, int64_t Kp, const float *bias, float *y, int64_t ldy, int threads) {
    if (Kp % 64 || Kp < K || Kp > QMM_MAX_K || M < 0 || N < 0 || ldx < K || ldy < N) return QMM_BAD_SHAPE;
    if (M == 0 || N == 0) return QMM_OK;
    const int isa = current_isa(), vnni = isa >= ISA_AVX512_VNNI;
    const size_t q_bytes = ((size_t)(M * Kp) + 63) & ~(size_t)63, f_bytes = ((size_t)M * sizeof(float) + 63) & ~(size_t)63;
    uint8_t *buffer = scratch(SCRATCH_KERNEL, q_bytes + 2 * f_bytes); /* xq, xd, xsum */
    if (!buffer) return QMM_NO_MEMORY;
    int8_t *xq = (int8_t *)buffer;
    float *xd = (float *)(buffer + q_bytes);
    int32_t *xsum = (int32_t *)(buffer + q_bytes + f_bytes);
#ifdef QMM_X86
    if (vnni) quantize_rows_avx512(x, M, K, ldx, mul, Kp, xq, xd, xsum);
    else
#endif
        quantize_rows_scalar(x, M, K, ldx, mul, Kp, xq, xd, xsum);
    const ChannelJob job = {xq, xd, xsum, M, Kp, N, codes, ws, bias, y, ldy};
    const int64_t groups = (N + CHANNEL_COLS - 1) / CHANNEL_COLS;
#ifdef _OPENMP
    if (threads > 1 && N >= 64) {
        const int64_t parts = threads;
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t t = 0; t < parts; t++) run_channel_gemm(isa, &job, groups * t / parts, groups * (t + 1) / parts);
        return QMM_OK;
    }
#else
    (void)threads;
#endif
    run_channel_gemm(isa, &job, 0, groups);
    return QMM_OK;
}

/* ------------------------------------------------------------------ a decoder layer's decode step
 *
 * One call for a whole Llama-family layer on a decode step (the torch path in engine/model/decoder.py
 * is the reference): residual add and RMSNorm, qkv projection, decode attention, o projection,
 * residual add and RMSNorm, gate_up projection, SiLU(gate) * up, down projection. A small model's
 * step is otherwise a few hundred small torch ops, each costing more than its arithmetic. */

typedef struct {
    const uint8_t *codes;
    const uint16_t *d, *m; /* blocks of 32: m NULL for 8-bit weights */
    const float *bias;     /* NULL: none */
    int64_t N, K, Kp, bits;
    int64_t per_channel;   /* 1: qmm_linear_channel's layout, with ws and mul (NULL: none); d, m, bits unused */
    const float *ws, *mul;
} QWeight;

typedef struct {
    int64_t hidden, intermediate, heads, kv_heads, head_dim, window; /* window <= 0: none */
    float eps1, eps2, scale;
    const float *norm1, *norm2; /* [hidden] */
    QWeight qkv, o, gate_up, down;
} DecodeLayer;

static int linear_run(const QWeight *w, const float *x, int64_t M, float *y, int threads) {
    if (w->per_channel) return qmm_linear_channel(x, M, w->K, w->K, w->mul, (const int8_t *)w->codes, w->ws, w->N, w->Kp, w->bias, y, w->N, threads);
    return qmm_linear(x, M, w->K, w->K, w->codes, w->d, w->m, w->N, w->Kp, (int)w->bits, w->bias, y, w->N, threads);
}

/* residual_out = x + residual (x alone when residual is NULL); h = RMSNorm(residual_out) * weight. */
static inline __attribute__((always_inline)) void add_norm_body(const float *x, const float *residual, float *residual_out,
                                                               const float *weight, float eps, int64_t T, int64_t H, float *h) {
    for (int64_t t = 0; t < T; t++) {
        const float *xr = x + t * H, *rr = residual ? residual + t * H : NULL;
        float *out = residual_out + t * H, *hr = h + t * H;
        if (rr) for (int64_t i = 0; i < H; i++) out[i] = xr[i] + rr[i];
        else memcpy(out, xr, (size_t)H * sizeof(float));
        const float ss = dot_f32(out, out, H);
        const float inv = 1.f / sqrtf(ss / (float)H + eps);
        for (int64_t i = 0; i < H; i++) hr[i] = out[i] * inv * weight[i];
    }
}

/* act[t, i] = SiLU(gate_up[t, i]) * gate_up[t, I + i]. */
static inline __attribute__((always_inline)) void silu_mul_body(const float *gate_up, int64_t T, int64_t I, float *act) {
    for (int64_t t = 0; t < T; t++) {
        const float *g = gate_up + t * 2 * I, *u = g + I;
        float *a = act + t * I;
        for (int64_t i = 0; i < I; i++) a[i] = g[i] / (1.f + exp_fast(-g[i])) * u[i];
    }
}

static void add_norm_scalar(const float *x, const float *r, float *ro, const float *w, float eps, int64_t T, int64_t H, float *h) {
    add_norm_body(x, r, ro, w, eps, T, H, h);
}
static void silu_mul_scalar(const float *gu, int64_t T, int64_t I, float *act) { silu_mul_body(gu, T, I, act); }
#ifdef QMM_X86
TARGET_AVX2 static void add_norm_avx2(const float *x, const float *r, float *ro, const float *w, float eps, int64_t T, int64_t H, float *h) {
    add_norm_body(x, r, ro, w, eps, T, H, h);
}
TARGET_AVX2 static void silu_mul_avx2(const float *gu, int64_t T, int64_t I, float *act) { silu_mul_body(gu, T, I, act); }
TARGET_AVX512 static void add_norm_avx512(const float *x, const float *r, float *ro, const float *w, float eps, int64_t T, int64_t H, float *h) {
    add_norm_body(x, r, ro, w, eps, T, H, h);
}
TARGET_AVX512 static void silu_mul_avx512(const float *gu, int64_t T, int64_t I, float *act) { silu_mul_body(gu, T, I, act); }
#endif

static void add_norm(int isa, const float *x, const float *r, float *ro, const float *w, float eps, int64_t T, int64_t H, float *h) {
#ifdef QMM_X86
    if (isa >= ISA_AVX512_VNNI) { add_norm_avx512(x, r, ro, w, eps, T, H, h); return; }
    if (isa == ISA_AVX2) { add_norm_avx2(x, r, ro, w, eps, T, H, h); return; }
#endif
    add_norm_scalar(x, r, ro, w, eps, T, H, h);
}

static void silu_mul(int isa, const float *gu, int64_t T, int64_t I, float *act) {
#ifdef QMM_X86
    if (isa >= ISA_AVX512_VNNI) { silu_mul_avx512(gu, T, I, act); return; }
    if (isa == ISA_AVX2) { silu_mul_avx2(gu, T, I, act); return; }
#endif
    silu_mul_scalar(gu, T, I, act);
}

/* One decode step of layer L for T sequences (row t = sequence t, one new token each): x [T, hidden] is
 * the layer's input (the embedding, or the previous layer's MLP output), residual [T, hidden] the residual
 * stream before it (NULL on the first layer). Writes the MLP output to x_out and the residual stream
 * after attention to residual_out (as DecoderLayer.forward returns them), and the tokens' K / V to the
 * cache. Returns 0 or a QMM_* code. */
int qmm_decode_layer(const DecodeLayer *L, const float *x, const float *residual, float *x_out, float *residual_out,
                     int64_t T, const float *cos, const float *sin, float *cache, int64_t num_blocks, int64_t block_size,
                     const int64_t *slots, const int32_t *block_tables, int64_t max_blocks, const int32_t *seq_lens,
                     int threads) {
    const int64_t H = L->hidden, I = L->intermediate, q_out = L->heads * L->head_dim;
    const int64_t qkv_out = (L->heads + 2 * L->kv_heads) * L->head_dim;
    if (L->qkv.K != H || L->qkv.N != qkv_out || L->o.K != q_out || L->o.N != H || L->gate_up.K != H ||
        L->gate_up.N != 2 * I || L->down.K != I || L->down.N != H || T < 0)
        return QMM_BAD_SHAPE;
    if (T == 0) return QMM_OK;
    float *buffer = scratch(SCRATCH_LAYER, (size_t)(T * (H + qkv_out + q_out + 3 * I)) * sizeof(float));
    if (!buffer) return QMM_NO_MEMORY;
    float *h = buffer, *qkv = h + T * H, *attn = qkv + T * qkv_out, *gate_up = attn + T * q_out, *act = gate_up + T * 2 * I;
    const int isa = current_isa();
    int rc;
    add_norm(isa, x, residual, residual_out, L->norm1, L->eps1, T, H, h);
    if ((rc = linear_run(&L->qkv, h, T, qkv, threads))) return rc;
    const Attention A = {qkv, qkv_out, cos, sin, cache, num_blocks, block_size, slots, block_tables, max_blocks,
                         seq_lens, L->heads, L->kv_heads, L->head_dim, L->window, L->scale, attn};
    if ((rc = attention_run(&A, T, threads))) return rc;
    if ((rc = linear_run(&L->o, attn, T, x_out, threads))) return rc;
    add_norm(isa, x_out, residual_out, residual_out, L->norm2, L->eps2, T, H, h);
    if ((rc = linear_run(&L->gate_up, h, T, gate_up, threads))) return rc;
    silu_mul(isa, gate_up, T, I, act);
    return linear_run(&L->down, act, T, x_out, threads);
}
