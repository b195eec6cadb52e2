// Decode attention (see include/miles_rollout/decode_attention.h).
//
// Per (row, kv head): the group's queries are widened to fp32 once; keys are widened 16 at a
// time into a small fp32 block, and each query's 16 dot products are summed lane-wise and then
// reduced together by one transpose-and-add tree (15 vector adds for 16 dots instead of a
// horizontal reduction per dot); the softmax runs over the row's live positions only; values
// are read once per position and accumulated for the whole group. The generic code computes
// exactly the same operations one lane at a time (compiled twice: plain, and with AVX2 + FMA so
// the compiler vectorizes it), so every variant gives the same bits. The file is compiled with
// -ffp-contract=off: no multiply-add is fused unless written as fma.
//
// Element types: bf16 (transformers' eager bf16 numerics: scores, probabilities and the output
// rounded to bf16) and fp32 (the same operations with every rounding to bf16 left out). The
// kernel is written once over an element trait (Bf16 / F32) that loads, stores and rounds.
#include "miles_rollout/decode_attention.h"

// GCC 12 reports the deliberately undefined operand inside its own AVX-512 intrinsics as
// maybe-uninitialized once they are inlined: a false positive.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <cmath>
#include <limits>
#include <vector>

#include "common.h"

namespace miles_rollout {
namespace {

using detail::bf16_to_f32;
using detail::bits_to_f32;
using detail::f32_to_bf16;
using detail::Isa;
using detail::round_bf16;
#ifdef MILES_X86
using detail::bf16_bits;
using detail::load_bf16;
using detail::round_bf16_v;
#endif

constexpr int kLanes = 16;

// What differs between the element types: widening to fp32, rounding an fp32 intermediate to
// the element type's precision (bf16: to nearest even; fp32: nothing) and storing.
struct Bf16 {
  using T = uint16_t;
  static MILES_INLINE float to_f32(T h) { return bf16_to_f32(h); }
  static MILES_INLINE float round(float x) { return round_bf16(x); }
  static MILES_INLINE T from_f32(float x) { return f32_to_bf16(x); }
#ifdef MILES_X86
  static MILES_AVX512 MILES_INLINE __m512 load(const T* p) { return load_bf16(p); }
  static MILES_AVX512 MILES_INLINE __m512 round_v(__m512 x) { return round_bf16_v(x); }
  static MILES_AVX512 MILES_INLINE void store(T* p, __m512 x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(x)));
  }
#endif
};

struct F32 {
  using T = float;
  static MILES_INLINE float to_f32(T x) { return x; }
  static MILES_INLINE float round(float x) { return x; }
  static MILES_INLINE T from_f32(float x) { return x; }
#ifdef MILES_X86
  static MILES_AVX512 MILES_INLINE __m512 load(const T* p) { return _mm512_loadu_ps(p); }
  static MILES_AVX512 MILES_INLINE __m512 round_v(__m512 x) { return x; }
  static MILES_AVX512 MILES_INLINE void store(T* p, __m512 x) { _mm512_storeu_ps(p, x); }
#endif
};

// exp(x) = 2^n * exp(r), n = rint(x * log2(e)), r = x - n * ln2 (ln2 in two parts, Cody-Waite),
// exp(r) by its Taylor series to r^7 (|r| <= ln2 / 2: truncation below 0.05 ulp).
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;
constexpr float kLn2Lo = -2.12194440e-4f;
// Below this exp rounds to zero in fp32; clamping keeps 2^n in range.
constexpr float kExpMin = -104.0f;
constexpr float kC2 = 1.0f / 2.0f;
constexpr float kC3 = 1.0f / 6.0f;
constexpr float kC4 = 1.0f / 24.0f;
constexpr float kC5 = 1.0f / 120.0f;
constexpr float kC6 = 1.0f / 720.0f;
constexpr float kC7 = 1.0f / 5040.0f;

MILES_INLINE float pow2i(int k) { return bits_to_f32(static_cast<uint32_t>(k + 127) << 23); }

MILES_INLINE float exp_f32(float x) {
  x = x > kExpMin ? x : kExpMin;  // as _mm512_max_ps(x, kExpMin), NaN included
  const float n = rintf(x * kLog2e);
  float r = fmaf(n, -kLn2Hi, x);
  r = fmaf(n, -kLn2Lo, r);
  float p = kC7;
  p = fmaf(p, r, kC6);
  p = fmaf(p, r, kC5);
  p = fmaf(p, r, kC4);
  p = fmaf(p, r, kC3);
  p = fmaf(p, r, kC2);
  p = fmaf(p, r, 1.0f);
  p = fmaf(p, r, 1.0f);
  const int ni = static_cast<int>(n);
  const int n1 = ni >> 1;  // two factors keep each power of two a normal number
  return p * pow2i(n1) * pow2i(ni - n1);
}

// The fixed lane tree: lane j + lane j+8, then +4, +2, +1 (a is clobbered).
MILES_INLINE float lane_sum(float* a) {
  for (int j = 0; j < 8; ++j) a[j] = a[j] + a[j + 8];
  for (int j = 0; j < 4; ++j) a[j] = a[j] + a[j + 4];
  for (int j = 0; j < 2; ++j) a[j] = a[j] + a[j + 2];
  return a[0] + a[1];
}

struct Scratch {
  std::vector<float> q;       // [group, head_dim]
  std::vector<float> kblock;  // [16, head_dim]
  std::vector<float> p;       // [group, padded length]: scores, then probabilities
};

Scratch& scratch() {
  static thread_local Scratch s;
  return s;
}

template <typename E>
struct Head {  // one (query token, kv head)
  const typename E::T* q;
  int64_t q_stride_g;
  const typename E::T* k;  // [t_cap, head_dim]
  const typename E::T* v;
  int64_t len;
  typename E::T* out;  // [group, head_dim]
};

// ---- generic (one lane at a time) ------------------------------------------------------------

template <typename E>
MILES_INLINE void head_generic(const Head<E>& h, int64_t group, int64_t d, float scale,
                               Scratch& s) {
  const int64_t len = h.len;
  const int64_t lp = (len + kLanes - 1) / kLanes * kLanes;
  s.q.resize(static_cast<size_t>(group * d));
  s.p.resize(static_cast<size_t>(group * lp));
  float* qf = s.q.data();
  for (int64_t g = 0; g < group; ++g)
    for (int64_t i = 0; i < d; ++i) qf[g * d + i] = E::to_f32(h.q[g * h.q_stride_g + i]);
  for (int64_t g = 0; g < group; ++g) {
    float* pg = s.p.data() + g * lp;
    const float* qg = qf + g * d;
    for (int64_t t = 0; t < len; ++t) {
      const typename E::T* kt = h.k + t * d;
      float acc[kLanes] = {};
      for (int64_t c = 0; c < d; c += kLanes)
        for (int j = 0; j < kLanes; ++j) acc[j] = fmaf(qg[c + j], E::to_f32(kt[c + j]), acc[j]);
      pg[t] = E::round(E::round(lane_sum(acc)) * scale);
    }
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < len; ++t) m = pg[t] > m ? pg[t] : m;
    float acc[kLanes] = {};
    for (int64_t t = 0; t < len; ++t) {
      pg[t] = exp_f32(pg[t] - m);
      acc[t % kLanes] = acc[t % kLanes] + pg[t];
    }
    const float sum = lane_sum(acc);
    for (int64_t t = 0; t < len; ++t) pg[t] = E::round(pg[t] / sum);
  }
  for (int64_t g = 0; g < group; ++g) {
    const float* pg = s.p.data() + g * lp;
    for (int64_t c = 0; c < d; c += kLanes) {
      float acc[kLanes] = {};
      for (int64_t t = 0; t < len; ++t) {
        const typename E::T* vt = h.v + t * d + c;
        for (int j = 0; j < kLanes; ++j) acc[j] = fmaf(pg[t], E::to_f32(vt[j]), acc[j]);
      }
      for (int j = 0; j < kLanes; ++j) h.out[g * d + c + j] = E::from_f32(acc[j]);
    }
  }
}

template <typename E>
void head_plain(const Head<E>& h, int64_t group, int64_t d, float scale, Scratch& s) {
  head_generic(h, group, d, scale, s);
}

#ifdef MILES_X86
template <typename E>
MILES_AVX2 void head_avx2(const Head<E>& h, int64_t group, int64_t d, float scale, Scratch& s) {
  head_generic(h, group, d, scale, s);
}

// ---- AVX-512 ---------------------------------------------------------------------------------

MILES_AVX512 MILES_INLINE __m512 exp_v(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(kExpMin));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Hi), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kC7);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kC6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kC5));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kC4));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kC3));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kC2));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512i ni = _mm512_cvtps_epi32(n);
  const __m512i n1 = _mm512_srai_epi32(ni, 1);
  const __m512i n2 = _mm512_sub_epi32(ni, n1);
  const __m512i bias = _mm512_set1_epi32(127);
  const __m512 f1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n1, bias), 23));
  const __m512 f2 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n2, bias), 23));
  return _mm512_mul_ps(_mm512_mul_ps(p, f1), f2);
}

// Lane sums of 16 vectors: slot i's sum lands in lane 4 * (i % 4) + i / 4, added in the order of
// lane_sum (stages pair lanes 8, 4, 2 and 1 apart).
MILES_AVX512 MILES_INLINE __m512 reduce16(const __m512* a) {
  __m512 w[8];
  for (int i = 0; i < 8; ++i)
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  __m512 u[4];
  for (int i = 0; i < 4; ++i)
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
  __m512 v[2];
  for (int i = 0; i < 2; ++i)
    v[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_ps(v[0], v[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(v[0], v[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// out[g0 .. g0+GB) [d0 .. d0 + 16*DC) = sum_t p[g][t] * V[t]: V read once for GB queries.
template <typename E, int GB, int DC>
MILES_AVX512 MILES_INLINE void pv_block(const Head<E>& h, int64_t d, const float* p, int64_t lp,
                                        int64_t g0, int64_t d0) {
  __m512 acc[GB][DC];
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < DC; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < h.len; ++t) {
    __m512 vv[DC];
    for (int c = 0; c < DC; ++c) vv[c] = E::load(h.v + t * d + d0 + c * kLanes);
    for (int g = 0; g < GB; ++g) {
      const __m512 pg = _mm512_set1_ps(p[(g0 + g) * lp + t]);
      for (int c = 0; c < DC; ++c) acc[g][c] = _mm512_fmadd_ps(pg, vv[c], acc[g][c]);
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < DC; ++c) E::store(h.out + (g0 + g) * d + d0 + c * kLanes, acc[g][c]);
}

template <typename E, int GB>
MILES_AVX512 MILES_INLINE void pv_group(const Head<E>& h, int64_t d, const float* p, int64_t lp,
                                        int64_t g0) {
  int64_t d0 = 0;
  for (; d0 + 4 * kLanes <= d; d0 += 4 * kLanes) pv_block<E, GB, 4>(h, d, p, lp, g0, d0);
  switch ((d - d0) / kLanes) {
    case 3: pv_block<E, GB, 3>(h, d, p, lp, g0, d0); break;
    case 2: pv_block<E, GB, 2>(h, d, p, lp, g0, d0); break;
    case 1: pv_block<E, GB, 1>(h, d, p, lp, g0, d0); break;
    default: break;
  }
}

template <typename E>
MILES_AVX512 void head_avx512(const Head<E>& h, int64_t group, int64_t d, float scale,
                              Scratch& s) {
  const int64_t len = h.len;
  const int64_t lp = (len + kLanes - 1) / kLanes * kLanes;
  s.q.resize(static_cast<size_t>(group * d));
  s.kblock.resize(static_cast<size_t>(kLanes * d));
  s.p.resize(static_cast<size_t>(group * lp));
  float* qf = s.q.data();
  float* kf = s.kblock.data();
  float* pf = s.p.data();
  const int64_t chunks = d / kLanes;
  for (int64_t g = 0; g < group; ++g)
    for (int64_t c = 0; c < chunks; ++c)
      _mm512_storeu_ps(qf + g * d + c * kLanes, E::load(h.q + g * h.q_stride_g + c * kLanes));
  const __m512 vscale = _mm512_set1_ps(scale);
  // Scores, 16 positions at a time; slot i of the block holds position t0 + 4 * (i % 4) + i / 4
  // so that reduce16 returns them in order.
  for (int64_t t0 = 0; t0 < len; t0 += kLanes) {
    for (int i = 0; i < kLanes; ++i) {
      const int64_t t = t0 + 4 * (i % 4) + i / 4;
      float* row = kf + i * d;
      if (t < len) {
        for (int64_t c = 0; c < chunks; ++c)
          _mm512_storeu_ps(row + c * kLanes, E::load(h.k + t * d + c * kLanes));
      } else {
        for (int64_t c = 0; c < chunks; ++c) _mm512_storeu_ps(row + c * kLanes, _mm512_setzero_ps());
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      __m512 acc[kLanes];
      for (int i = 0; i < kLanes; ++i) acc[i] = _mm512_setzero_ps();
      for (int64_t c = 0; c < chunks; ++c) {
        const __m512 qv = _mm512_loadu_ps(qf + g * d + c * kLanes);
#pragma GCC unroll 16
        for (int i = 0; i < kLanes; ++i)
          acc[i] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kf + i * d + c * kLanes), acc[i]);
      }
      const __m512 sc = E::round_v(_mm512_mul_ps(E::round_v(reduce16(acc)), vscale));
      _mm512_storeu_ps(pf + g * lp + t0, sc);
    }
  }
  // Softmax over the live positions of each query.
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t g = 0; g < group; ++g) {
    float* pg = pf + g * lp;
    __m512 mv = ninf;
    for (int64_t t0 = 0; t0 < len; t0 += kLanes) {
      const int64_t live = len - t0 < kLanes ? len - t0 : kLanes;
      const __mmask16 mask = static_cast<__mmask16>((1u << live) - 1u);
      mv = _mm512_max_ps(mv, _mm512_mask_mov_ps(ninf, mask, _mm512_loadu_ps(pg + t0)));
    }
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
    __m512 sv = _mm512_setzero_ps();
    for (int64_t t0 = 0; t0 < len; t0 += kLanes) {
      const int64_t live = len - t0 < kLanes ? len - t0 : kLanes;
      const __mmask16 mask = static_cast<__mmask16>((1u << live) - 1u);
      const __m512 e =
          _mm512_maskz_mov_ps(mask, exp_v(_mm512_sub_ps(_mm512_loadu_ps(pg + t0), m)));
      _mm512_storeu_ps(pg + t0, e);
      sv = _mm512_add_ps(sv, e);
    }
    alignas(64) float lanes[kLanes];
    _mm512_store_ps(lanes, sv);
    const __m512 sum = _mm512_set1_ps(lane_sum(lanes));
    for (int64_t t0 = 0; t0 < len; t0 += kLanes)
      _mm512_storeu_ps(pg + t0, E::round_v(_mm512_div_ps(_mm512_loadu_ps(pg + t0), sum)));
  }
  int64_t g0 = 0;
  for (; g0 + 4 <= group; g0 += 4) pv_group<E, 4>(h, d, pf, lp, g0);
  switch (group - g0) {
    case 3: pv_group<E, 3>(h, d, pf, lp, g0); break;
    case 2: pv_group<E, 2>(h, d, pf, lp, g0); break;
    case 1: pv_group<E, 1>(h, d, pf, lp, g0); break;
    default: break;
  }
}
#endif  // MILES_X86

template <typename E>
void run(const DecodeAttention& a) {
  using T = typename E::T;
  using Fn = void (*)(const Head<E>&, int64_t, int64_t, float, Scratch&);
  Fn fn = head_plain<E>;
#ifdef MILES_X86
  if (detail::active_isa() == Isa::kAvx512) fn = head_avx512<E>;
  if (detail::active_isa() == Isa::kAvx2) fn = head_avx2<E>;
#endif
  Scratch& s = scratch();
  const int64_t d = a.head_dim;
  const T* q = static_cast<const T*>(a.q);
  const T* k = static_cast<const T*>(a.k);
  const T* v = static_cast<const T*>(a.v);
  T* out = static_cast<T*>(a.out);
  for (int64_t b = 0; b < a.n; ++b) {
    const int64_t row = a.rows != nullptr ? a.rows[b] : b;
    for (int64_t kv = 0; kv < a.kv_heads; ++kv) {
      const int64_t cache_off = (row * a.kv_heads + kv) * a.t_cap * d;
      const Head<E> h{q + b * a.q_stride_n + kv * a.q_stride_kv,
                      a.q_stride_g,
                      k + cache_off,
                      v + cache_off,
                      a.lengths[b],
                      out + (b * a.kv_heads + kv) * a.group * d};
      fn(h, a.group, d, a.scale, s);
    }
  }
}

}  // namespace

int64_t decode_attention(const DecodeAttention& a) {
  for (int64_t b = 0; b < a.n; ++b) {
    if (a.lengths[b] < 1 || a.lengths[b] > a.t_cap) return b + 1;
    if (a.rows != nullptr && (a.rows[b] < 0 || a.rows[b] >= a.batch_cap)) return -(b + 1);
  }
  if (a.fp32)
    run<F32>(a);
  else
    run<Bf16>(a);
  return 0;
}

}  // namespace miles_rollout
