// Disk-delta kernels (see include/miles_transfer/delta_scan.h).
//
// delta_scan reads base and next once, 64 bytes at a time, and feeds the same bytes to the
// XXH3 checksums. AVX-512 (with VBMI and VBMI2): one compare gives the mask of changed
// elements, and compress instructions write their positions and values without a branch per
// block or per element (at an RL step's ~2% change rate half the blocks of bf16 hold a change,
// so branches would mispredict constantly); dense chunks' byte planes take one byte permute
// per 64 bytes. AVX2 and portable code: a byte-inequality mask folded to one bit per element,
// and a loop over its set bits. The other kernels are loops over the k changed elements or
// over byte planes, written so the compiler vectorizes them; each is compiled once per
// instruction set (always_inline bodies called from functions with a target attribute).
#include "miles_transfer/delta_scan.h"

// GCC 12 reports the deliberately undefined operand inside its own AVX-512 intrinsics
// (_mm512_undefined_epi32) as maybe-uninitialized once they are inlined: a false positive.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <cstring>
#include <vector>

#include "xxh3_long.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define MILES_X86 1
#define MILES_AVX2 __attribute__((target("avx2,bmi,bmi2,popcnt")))
#define MILES_AVX512                                                                         \
  __attribute__((                                                                             \
      target("avx512f,avx512bw,avx512vl,avx512vbmi,avx512vbmi2,avx2,bmi,bmi2,popcnt")))
#endif
#define MILES_INLINE inline __attribute__((always_inline))

namespace miles_transfer {
namespace {

constexpr int64_t kBlock = 64;  // bytes compared per step
// Prefetch distance of the scans: one core's hardware prefetchers alone kept the two input
// streams at about 10 GB/s here; 2 KiB ahead reached 12-14 GB/s (512 B and 8 KiB: less).
// Prefetches never fault, so reading past the end is harmless.
constexpr int64_t kPrefetch = 2048;

template <int W>
MILES_INLINE uint64_t load_elem(const uint8_t* p) {
  uint64_t v = 0;
  std::memcpy(&v, p, W);  // little-endian hosts only (x86, arm64): the bytes as stored
  return v;
}

template <int W>
MILES_INLINE void store_elem(uint8_t* p, uint64_t v) {
  std::memcpy(p, &v, W);
}

// One bit per element (at its first byte) from a mask of differing bytes.
template <int W>
MILES_INLINE uint64_t fold(uint64_t m) {
  if (W == 1) return m;
  if (W == 2) return (m | (m >> 1)) & 0x5555555555555555ULL;
  m |= m >> 1;
  m |= m >> 2;
  if (W == 4) return m & 0x1111111111111111ULL;
  m |= m >> 4;
  return m & 0x0101010101010101ULL;
}

// Byte-inequality mask of one 64-byte block, portable: bit b set iff a[b] != b[b].
struct MaskGeneric {
  MILES_INLINE uint64_t operator()(const uint8_t* a, const uint8_t* b) const;
};

MILES_INLINE uint64_t MaskGeneric::operator()(const uint8_t* a, const uint8_t* b) const {
  uint64_t m = 0;
  for (int w = 0; w < 8; ++w) {
    uint64_t x, y;
    std::memcpy(&x, a + 8 * w, 8);
    std::memcpy(&y, b + 8 * w, 8);
    uint64_t d = x ^ y;
    if (!d) continue;
    d |= d >> 4;
    d |= d >> 2;
    d |= d >> 1;
    d &= 0x0101010101010101ULL;  // bit 8j set iff byte j differs
    m |= ((d * 0x0102040810204080ULL) >> 56) << (8 * w);
  }
  return m;
}

// ---- delta_scan: mask + bit loop (portable, AVX2) ----

template <int W, bool XOR>
struct Emitter {
  const uint8_t* base;
  const uint8_t* next;
  int32_t* positions;
  uint8_t* values;
  int64_t cap;
  int64_t k = 0;

  MILES_INLINE void emit(uint64_t em, int64_t off) {
    if (k + __builtin_popcountll(em) > cap) {  // too many for a sparse chunk: count only
      k += __builtin_popcountll(em);
      return;
    }
    while (em) {
      const int64_t byte = off + __builtin_ctzll(em);
      em &= em - 1;
      positions[k] = static_cast<int32_t>(byte / W);
      uint64_t v = load_elem<W>(next + byte);
      if (XOR) v ^= load_elem<W>(base + byte);
      store_elem<W>(values + k * W, v);
      ++k;
    }
  }
};

void hash_scalar(Xxh3Long* st, const uint8_t* data, int64_t offset, int64_t bytes) {
  const int64_t last = xxh3::regular_stripes(st->len);
  for (int64_t s = offset / 64, o = 0; o + 64 <= bytes && s < last; ++s, o += 64)
    xxh3::stripe_scalar(st->acc, data + o, s);
}

// XXH3 accumulators of one input kept in locals across a scan (the register state of each
// instruction set): load, one 64-byte stripe at a time, store.
struct HashScalar {
  uint64_t acc[8];
  MILES_INLINE void load(const Xxh3Long* st) { std::memcpy(acc, st->acc, sizeof(acc)); }
  MILES_INLINE void step(const uint8_t* p, int64_t s) { xxh3::stripe_scalar(acc, p, s); }
  MILES_INLINE void store(Xxh3Long* st) const { std::memcpy(st->acc, acc, sizeof(acc)); }
};

// The bit-loop scan, defined per instruction set (an always_inline body cannot call a
// target-specific mask function unless it has that target itself).
#define MILES_SCAN_BITS(NAME, ATTR, MASK, HASH)                                                 \
  template <int W, bool XOR>                                                                    \
  ATTR int64_t NAME(const uint8_t* base, const uint8_t* next, int64_t n, int32_t* positions,    \
                    uint8_t* values, int64_t cap, Xxh3Long* hn, Xxh3Long* hb, int64_t ho) {     \
    Emitter<W, XOR> e{base, next, positions, values, cap};                                      \
    HASH sn, sb;                                                                                \
    int64_t stripe = ho / 64, last = 0;                                                         \
    if (hn) sn.load(hn), last = xxh3::regular_stripes(hn->len);                                 \
    if (hb) sb.load(hb), last = xxh3::regular_stripes(hb->len);                                 \
    const int64_t bytes = n * W;                                                                \
    const int64_t full = bytes - bytes % kBlock;                                                \
    for (int64_t off = 0; off < full; off += kBlock, ++stripe) {                                \
      __builtin_prefetch(base + off + kPrefetch);                                               \
      __builtin_prefetch(next + off + kPrefetch);                                               \
      const uint64_t m = MASK{}(base + off, next + off);                                        \
      if (m) e.emit(fold<W>(m), off);                                                           \
      if (stripe < last) {                                                                      \
        if (hn) sn.step(next + off, stripe);                                                    \
        if (hb) sb.step(base + off, stripe);                                                    \
      }                                                                                         \
    }                                                                                           \
    if (hn) sn.store(hn);                                                                       \
    if (hb) sb.store(hb);                                                                       \
    if (full < bytes) { /* the tail, zero-padded: padding never differs */                      \
      uint8_t a[kBlock] = {0}, b[kBlock] = {0};                                                 \
      std::memcpy(a, base + full, static_cast<size_t>(bytes - full));                           \
      std::memcpy(b, next + full, static_cast<size_t>(bytes - full));                           \
      const uint64_t m = MaskGeneric{}(a, b);                                                   \
      if (m) e.emit(fold<W>(m), full);                                                          \
    }                                                                                           \
    return e.k;                                                                                 \
  }

MILES_SCAN_BITS(scan_bits_generic, , MaskGeneric, HashScalar)

// ---- the O(k) and byte-plane loops (vectorized by the compiler per target) ----

// Sparse layout from positions and values: gap planes, then value planes.
template <int W>
MILES_INLINE void pack_sparse(const int32_t* positions, const uint8_t* values, int64_t k,
                              uint8_t* out) {
  uint8_t* g0 = out;
  for (int64_t i = 0; i < k; ++i) {
    const uint32_t gap = static_cast<uint32_t>(positions[i] - (i ? positions[i - 1] : 0));
    g0[i] = static_cast<uint8_t>(gap);
    g0[k + i] = static_cast<uint8_t>(gap >> 8);
    g0[2 * k + i] = static_cast<uint8_t>(gap >> 16);
    g0[3 * k + i] = static_cast<uint8_t>(gap >> 24);
  }
  uint8_t* v0 = out + 4 * k;
  for (int64_t i = 0; i < k; ++i) {
    const uint64_t v = load_elem<W>(values + i * W);
    for (int j = 0; j < W; ++j) v0[j * k + i] = static_cast<uint8_t>(v >> (8 * j));
  }
}

// Byte planes of (next ^ base) or next; base unused when !XOR.
template <int W, bool XOR>
MILES_INLINE void planes(const uint8_t* base, const uint8_t* next, int64_t n, uint8_t* out) {
  for (int64_t i = 0; i < n; ++i) {
    uint64_t v = load_elem<W>(next + i * W);
    if (XOR) v ^= load_elem<W>(base + i * W);
    for (int j = 0; j < W; ++j) out[j * n + i] = static_cast<uint8_t>(v >> (8 * j));
  }
}

template <int W>
MILES_INLINE uint64_t gather(const uint8_t* raw, int64_t n, int64_t i) {
  uint64_t v = 0;
  for (int j = 0; j < W; ++j) v |= static_cast<uint64_t>(raw[j * n + i]) << (8 * j);
  return v;
}

template <int W, bool XOR>
MILES_INLINE void unplanes(uint8_t* target, int64_t n, const uint8_t* raw) {
  for (int64_t i = 0; i < n; ++i) {
    uint64_t v = gather<W>(raw, n, i);
    if (XOR) v ^= load_elem<W>(target + i * W);
    store_elem<W>(target + i * W, v);
  }
}

// Gaps from their planes into `gaps`; returns the last position (their sum), or -1 when they
// do not increase strictly (the first gap may be 0: position 0; every later one must be > 0).
MILES_INLINE int32_t gap_at(const uint8_t* raw, int64_t k, int64_t i) {
  return static_cast<int32_t>(static_cast<uint32_t>(raw[i]) |
                              (static_cast<uint32_t>(raw[k + i]) << 8) |
                              (static_cast<uint32_t>(raw[2 * k + i]) << 16) |
                              (static_cast<uint32_t>(raw[3 * k + i]) << 24));
}

MILES_INLINE int64_t unpack_gaps(const uint8_t* raw, int64_t k, int32_t* gaps) {
  if (k == 0) return 0;
  gaps[0] = gap_at(raw, k, 0);
  int32_t low = gaps[0] < 0 ? 0 : 1;  // 0 marks a bad gap
  int64_t sum = gaps[0];
  for (int64_t i = 1; i < k; ++i) {
    const int32_t g = gap_at(raw, k, i);
    gaps[i] = g;
    low = g < low ? g : low;
    sum += g;
  }
  return low <= 0 ? -1 : sum;
}

template <int W, bool XOR>
MILES_INLINE void scatter(uint8_t* target, const int32_t* gaps, const uint8_t* vals, int64_t k) {
  int64_t pos = 0;
  for (int64_t i = 0; i < k; ++i) {
    pos += gaps[i];
    uint64_t v = gather<W>(vals, k, i);
    if (XOR) v ^= load_elem<W>(target + pos * W);
    store_elem<W>(target + pos * W, v);
  }
}

// The patches of a sparse chunk whose positions are below `end` (elements), resuming at entry
// *j whose position is *pos; both advanced.
template <int W, bool XOR>
MILES_INLINE void scatter_range(uint8_t* target, const int32_t* gaps, const uint8_t* vals,
                                int64_t k, int64_t* j, int64_t* pos, int64_t end) {
  int64_t i = *j, p = *pos;
  while (i < k && p < end) {
    uint64_t v = gather<W>(vals, k, i);
    if (XOR) v ^= load_elem<W>(target + p * W);
    store_elem<W>(target + p * W, v);
    if (++i < k) p += gaps[i];
  }
  *j = i;
  *pos = p;
}

template <int W, bool XOR>
MILES_INLINE void unplanes_range(uint8_t* target, int64_t n, const uint8_t* raw, int64_t i0,
                                 int64_t i1) {
  for (int64_t i = i0; i < i1; ++i) {
    uint64_t v = gather<W>(raw, n, i);
    if (XOR) v ^= load_elem<W>(target + i * W);
    store_elem<W>(target + i * W, v);
  }
}

#ifdef MILES_X86
// ---- delta_scan with AVX-512 compress ----

template <int W>
struct Lanes;
template <>
struct Lanes<1> {
  MILES_AVX512 static uint64_t ne(__m512i a, __m512i b) { return _mm512_cmpneq_epu8_mask(a, b); }
  MILES_AVX512 static __m512i compress(uint64_t m, __m512i v) {
    return _mm512_maskz_compress_epi8(m, v);
  }
};
template <>
struct Lanes<2> {
  MILES_AVX512 static uint64_t ne(__m512i a, __m512i b) { return _mm512_cmpneq_epu16_mask(a, b); }
  MILES_AVX512 static __m512i compress(uint64_t m, __m512i v) {
    return _mm512_maskz_compress_epi16(static_cast<__mmask32>(m), v);
  }
};
template <>
struct Lanes<4> {
  MILES_AVX512 static uint64_t ne(__m512i a, __m512i b) { return _mm512_cmpneq_epu32_mask(a, b); }
  MILES_AVX512 static __m512i compress(uint64_t m, __m512i v) {
    return _mm512_maskz_compress_epi32(static_cast<__mmask16>(m), v);
  }
};
template <>
struct Lanes<8> {
  MILES_AVX512 static uint64_t ne(__m512i a, __m512i b) { return _mm512_cmpneq_epu64_mask(a, b); }
  MILES_AVX512 static __m512i compress(uint64_t m, __m512i v) {
    return _mm512_maskz_compress_epi64(static_cast<__mmask8>(m), v);
  }
};

// One XXH3 stripe (64 bytes, in a register) of stripe number s, then the scramble after every
// 16th (the scalar xxh3::stripe_scalar, eight lanes at once).
MILES_AVX512 MILES_INLINE __m512i stripe_avx512(__m512i acc, __m512i data, int64_t s) {
  const __m512i key = _mm512_loadu_si512(xxh3::kSecret + (s % xxh3::kStripesPerBlock) * 8);
  const __m512i dk = _mm512_xor_si512(data, key);
  const __m512i prod = _mm512_mul_epu32(dk, _mm512_srli_epi64(dk, 32));
  const __m512i swapped = _mm512_shuffle_epi32(data, static_cast<_MM_PERM_ENUM>(0x4E));
  acc = _mm512_add_epi64(acc, _mm512_add_epi64(prod, swapped));
  if (s % xxh3::kStripesPerBlock == xxh3::kStripesPerBlock - 1) {
    acc = _mm512_xor_si512(acc, _mm512_srli_epi64(acc, 47));
    acc = _mm512_xor_si512(acc, _mm512_loadu_si512(xxh3::kSecret + xxh3::kScrambleAt));
    const __m512i prime = _mm512_set1_epi64(static_cast<int64_t>(xxh3::kP32_1));
    const __m512i lo = _mm512_mul_epu32(acc, prime);
    const __m512i hi = _mm512_mul_epu32(_mm512_srli_epi64(acc, 32), prime);
    acc = _mm512_add_epi64(lo, _mm512_slli_epi64(hi, 32));
  }
  return acc;
}

MILES_AVX512 void hash_avx512(Xxh3Long* st, const uint8_t* data, int64_t offset, int64_t bytes) {
  __m512i acc = _mm512_loadu_si512(st->acc);
  const int64_t last = xxh3::regular_stripes(st->len);
  for (int64_t s = offset / 64, o = 0; o + 64 <= bytes && s < last; ++s, o += 64)
    acc = stripe_avx512(acc, _mm512_loadu_si512(data + o), s);
  _mm512_storeu_si512(st->acc, acc);
}

// Needs `positions` to hold cap + 16 entries and `values` cap * W + 64 bytes (full-vector
// stores past the last entry). With HN / HB, each 64-byte block of next / base is also an XXH3
// stripe of hn / hb (hash_offset is a multiple of 64).
template <int W, bool XOR, bool HN, bool HB>
MILES_AVX512 int64_t scan_avx512(const uint8_t* base, const uint8_t* next, int64_t n,
                                 int32_t* positions, uint8_t* values, int64_t cap, Xxh3Long* hn,
                                 Xxh3Long* hb, int64_t hash_offset) {
  constexpr int64_t E = kBlock / W;  // elements per block
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512i acc_n = _mm512_setzero_si512(), acc_b = _mm512_setzero_si512();
  int64_t stripe = hash_offset / 64, last = 0;
  if (HN) acc_n = _mm512_loadu_si512(hn->acc);
  if (HB) acc_b = _mm512_loadu_si512(hb->acc);
  if (HN) last = xxh3::regular_stripes(hn->len);
  if (HB) last = xxh3::regular_stripes(hb->len);
  int64_t k = 0;
  bool dense = false;
  for (int64_t i = 0; i < n; i += E, ++stripe) {
    __m512i a, b;
    if (i + E <= n) {
      __builtin_prefetch(base + i * W + kPrefetch);
      __builtin_prefetch(next + i * W + kPrefetch);
      a = _mm512_loadu_si512(base + i * W);
      b = _mm512_loadu_si512(next + i * W);
      if ((HN || HB) && stripe < last) {
        if (HN) acc_n = stripe_avx512(acc_n, b, stripe);
        if (HB) acc_b = stripe_avx512(acc_b, a, stripe);
      }
    } else {  // the tail: masked loads, the missing lanes read as equal zeros
      const __mmask64 live = _bzhi_u64(~0ULL, static_cast<unsigned>((n - i) * W));
      a = _mm512_maskz_loadu_epi8(live, base + i * W);
      b = _mm512_maskz_loadu_epi8(live, next + i * W);
    }
    const uint64_t m = Lanes<W>::ne(a, b);
    const int c = __builtin_popcountll(m);
    if (dense || k + c > cap) {  // too many for a sparse chunk: count only
      dense = true;
      k += c;
      continue;
    }
    const __m512i v = XOR ? _mm512_xor_si512(a, b) : b;
    _mm512_storeu_si512(values + k * W, Lanes<W>::compress(m, v));
    int64_t kk = k;
    for (int64_t g = 0; g < E; g += 16) {  // positions, 16 lanes of int32 at a time
      const __mmask16 sm = static_cast<__mmask16>(m >> g);
      const __m512i idx = _mm512_add_epi32(iota, _mm512_set1_epi32(static_cast<int32_t>(i + g)));
      _mm512_storeu_si512(positions + kk, _mm512_maskz_compress_epi32(sm, idx));
      kk += __builtin_popcount(static_cast<unsigned>(sm));
    }
    k += c;
  }
  if (HN) _mm512_storeu_si512(hn->acc, acc_n);
  if (HB) _mm512_storeu_si512(hb->acc, acc_b);
  return k;
}

// Byte planes of 64-byte blocks with one byte permute: lane j * (64 / W) + e of the permuted
// block is byte j of element e. Tails go through the portable loops.
template <int W>
MILES_AVX512 MILES_INLINE __m512i plane_index() {
  alignas(64) uint8_t idx[64];
  for (int j = 0; j < W; ++j)
    for (int e = 0; e < 64 / W; ++e) idx[j * (64 / W) + e] = static_cast<uint8_t>(e * W + j);
  return _mm512_load_si512(idx);
}

template <int W>
MILES_AVX512 MILES_INLINE __m512i unplane_index() {
  alignas(64) uint8_t idx[64];
  for (int j = 0; j < W; ++j)
    for (int e = 0; e < 64 / W; ++e) idx[e * W + j] = static_cast<uint8_t>(j * (64 / W) + e);
  return _mm512_load_si512(idx);
}

template <int W, bool XOR>
MILES_AVX512 void planes_avx512(const uint8_t* base, const uint8_t* next, int64_t n,
                                uint8_t* out) {
  constexpr int64_t E = 64 / W;
  const __m512i idx = plane_index<W>();
  int64_t i = 0;
  for (; i + E <= n; i += E) {
    __m512i v = _mm512_loadu_si512(next + i * W);
    if (XOR) v = _mm512_xor_si512(v, _mm512_loadu_si512(base + i * W));
    alignas(64) uint8_t t[64];
    _mm512_store_si512(t, _mm512_permutexvar_epi8(idx, v));
    for (int j = 0; j < W; ++j) std::memcpy(out + j * n + i, t + j * E, E);
  }
  for (; i < n; ++i) {
    uint64_t v = load_elem<W>(next + i * W);
    if (XOR) v ^= load_elem<W>(base + i * W);
    for (int j = 0; j < W; ++j) out[j * n + i] = static_cast<uint8_t>(v >> (8 * j));
  }
}

template <int W, bool XOR>
MILES_AVX512 void unplanes_range_avx512(uint8_t* target, int64_t n, const uint8_t* raw,
                                        int64_t i0, int64_t i1) {
  constexpr int64_t E = 64 / W;
  const __m512i idx = unplane_index<W>();
  int64_t i = i0;
  for (; i + E <= i1; i += E) {
    alignas(64) uint8_t t[64];
    for (int j = 0; j < W; ++j) std::memcpy(t + j * E, raw + j * n + i, E);
    __m512i v = _mm512_permutexvar_epi8(idx, _mm512_load_si512(t));
    if (XOR) v = _mm512_xor_si512(v, _mm512_loadu_si512(target + i * W));
    _mm512_storeu_si512(target + i * W, v);
  }
  unplanes_range<W, XOR>(target, n, raw, i, i1);
}

template <int W, bool XOR>
MILES_AVX512 void unplanes_avx512(uint8_t* target, int64_t n, const uint8_t* raw) {
  unplanes_range_avx512<W, XOR>(target, n, raw, 0, n);
}

struct MaskAvx2 {
  MILES_AVX2 MILES_INLINE uint64_t operator()(const uint8_t* a, const uint8_t* b) const {
  const __m256i a0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
  const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
  const __m256i a1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 32));
  const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32));
  const uint32_t eq0 = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi8(a0, b0)));
  const uint32_t eq1 = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi8(a1, b1)));
  return ~(static_cast<uint64_t>(eq0) | (static_cast<uint64_t>(eq1) << 32));
  }
};

// Two 256-bit halves of the accumulators (xxh3::stripe_scalar, four lanes at once).
struct HashAvx2 {
  __m256i acc[2];
  MILES_AVX2 MILES_INLINE void load(const Xxh3Long* st) {
    acc[0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(st->acc));
    acc[1] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(st->acc + 4));
  }
  MILES_AVX2 MILES_INLINE void store(Xxh3Long* st) const {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(st->acc), acc[0]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(st->acc + 4), acc[1]);
  }
  MILES_AVX2 MILES_INLINE void step(const uint8_t* p, int64_t s) {
    const uint8_t* key = xxh3::kSecret + (s % xxh3::kStripesPerBlock) * 8;
    const bool scramble = s % xxh3::kStripesPerBlock == xxh3::kStripesPerBlock - 1;
    const __m256i prime = _mm256_set1_epi64x(static_cast<int64_t>(xxh3::kP32_1));
    for (int h = 0; h < 2; ++h) {
      const __m256i data = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * h));
      const __m256i k = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(key + 32 * h));
      const __m256i dk = _mm256_xor_si256(data, k);
      const __m256i prod = _mm256_mul_epu32(dk, _mm256_srli_epi64(dk, 32));
      const __m256i swapped = _mm256_shuffle_epi32(data, 0x4E);
      __m256i a = _mm256_add_epi64(acc[h], _mm256_add_epi64(prod, swapped));
      if (scramble) {
        a = _mm256_xor_si256(a, _mm256_srli_epi64(a, 47));
        a = _mm256_xor_si256(a, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                    xxh3::kSecret + xxh3::kScrambleAt + 32 * h)));
        const __m256i lo = _mm256_mul_epu32(a, prime);
        const __m256i hi = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), prime);
        a = _mm256_add_epi64(lo, _mm256_slli_epi64(hi, 32));
      }
      acc[h] = a;
    }
  }
};

MILES_SCAN_BITS(scan_bits_avx2, MILES_AVX2, MaskAvx2, HashAvx2)

MILES_AVX2 void hash_avx2(Xxh3Long* st, const uint8_t* data, int64_t offset, int64_t bytes) {
  HashAvx2 h;
  h.load(st);
  const int64_t last = xxh3::regular_stripes(st->len);
  for (int64_t s = offset / 64, o = 0; o + 64 <= bytes && s < last; ++s, o += 64)
    h.step(data + o, s);
  h.store(st);
}
#endif
#undef MILES_SCAN_BITS

enum class Isa { kGeneric, kAvx2, kAvx512 };

Isa detect() {
#ifdef MILES_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vbmi") &&
      __builtin_cpu_supports("avx512vbmi2") && __builtin_cpu_supports("bmi2"))
    return Isa::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi2")) return Isa::kAvx2;
#endif
  return Isa::kGeneric;
}

const Isa kBest = detect();
Isa g_isa = kBest;  // set once at load; delta_use_isa may lower it (tests)

// Every kernel, per width and value kind, compiled once per instruction set.
#define MILES_KERNELS(NS, ATTR, SCAN, PLANES, UNPLANES, UNPLANES_RANGE)                         \
  namespace NS {                                                                                \
  template <int W, bool XOR>                                                                    \
  struct Ops {                                                                                  \
    ATTR static int64_t scan(const uint8_t* b, const uint8_t* x, int64_t n, int32_t* p,         \
                             uint8_t* v, int64_t cap, Xxh3Long* h, Xxh3Long* hb, int64_t ho) {  \
      return SCAN;                                                                              \
    }                                                                                           \
    ATTR static void pack(const int32_t* p, const uint8_t* v, int64_t k, uint8_t* out) {        \
      pack_sparse<W>(p, v, k, out);                                                             \
    }                                                                                           \
    ATTR static void planes(const uint8_t* b, const uint8_t* x, int64_t n, uint8_t* out) {      \
      PLANES<W, XOR>(b, x, n, out);                                                             \
    }                                                                                           \
    ATTR static void unplanes(uint8_t* t, int64_t n, const uint8_t* raw) {                      \
      UNPLANES<W, XOR>(t, n, raw);                                                              \
    }                                                                                           \
    ATTR static void scatter(uint8_t* t, const int32_t* g, const uint8_t* v, int64_t k) {       \
      miles_transfer::scatter<W, XOR>(t, g, v, k);                                              \
    }                                                                                           \
    ATTR static void scatter_range(uint8_t* t, const int32_t* g, const uint8_t* v, int64_t k,   \
                                   int64_t* j, int64_t* pos, int64_t end) {                     \
      miles_transfer::scatter_range<W, XOR>(t, g, v, k, j, pos, end);                           \
    }                                                                                           \
    ATTR static void unplanes_range(uint8_t* t, int64_t n, const uint8_t* raw, int64_t i0,      \
                                    int64_t i1) {                                               \
      UNPLANES_RANGE<W, XOR>(t, n, raw, i0, i1);                                                \
    }                                                                                           \
  };                                                                                            \
  ATTR int64_t gaps(const uint8_t* raw, int64_t k, int32_t* out) {                              \
    return unpack_gaps(raw, k, out);                                                            \
  }                                                                                             \
  }

MILES_KERNELS(generic, , (scan_bits_generic<W, XOR>(b, x, n, p, v, cap, h, hb, ho)),
              miles_transfer::planes, miles_transfer::unplanes, miles_transfer::unplanes_range)
#ifdef MILES_X86
MILES_KERNELS(avx2, MILES_AVX2, (scan_bits_avx2<W, XOR>(b, x, n, p, v, cap, h, hb, ho)),
              miles_transfer::planes, miles_transfer::unplanes, miles_transfer::unplanes_range)
MILES_KERNELS(avx512, MILES_AVX512,
              (h ? (hb ? scan_avx512<W, XOR, true, true>(b, x, n, p, v, cap, h, hb, ho)
                       : scan_avx512<W, XOR, true, false>(b, x, n, p, v, cap, h, hb, ho))
                 : (hb ? scan_avx512<W, XOR, false, true>(b, x, n, p, v, cap, h, hb, ho)
                       : scan_avx512<W, XOR, false, false>(b, x, n, p, v, cap, h, hb, ho))),
              planes_avx512, unplanes_avx512, unplanes_range_avx512)
#endif
#undef MILES_KERNELS

// Calls F(Ops<W, XOR>) with the instruction set in use, for a run-time width and value kind.
template <template <int, bool> class Ops, typename F>
auto with_ops(int width, bool xor_values, F&& f) {
  switch (width * 2 + (xor_values ? 1 : 0)) {
    case 2: return f(Ops<1, false>{});
    case 3: return f(Ops<1, true>{});
    case 4: return f(Ops<2, false>{});
    case 5: return f(Ops<2, true>{});
    case 8: return f(Ops<4, false>{});
    case 9: return f(Ops<4, true>{});
    case 16: return f(Ops<8, false>{});
    default: return f(Ops<8, true>{});
  }
}

template <typename F>
auto dispatch(int width, bool xor_values, F&& f) {
#ifdef MILES_X86
  if (g_isa == Isa::kAvx512) return with_ops<avx512::Ops>(width, xor_values, f);
  if (g_isa == Isa::kAvx2) return with_ops<avx2::Ops>(width, xor_values, f);
#endif
  return with_ops<generic::Ops>(width, xor_values, f);
}

int64_t unpack_gaps_isa(const uint8_t* raw, int64_t k, int32_t* out) {
#ifdef MILES_X86
  if (g_isa == Isa::kAvx512) return avx512::gaps(raw, k, out);
  if (g_isa == Isa::kAvx2) return avx2::gaps(raw, k, out);
#endif
  return generic::gaps(raw, k, out);
}

}  // namespace

int64_t delta_scan(const uint8_t* base, const uint8_t* next, int64_t n, int width, bool xor_values,
                   int32_t* positions, uint8_t* values, int64_t cap, Xxh3Long* hash_next,
                   Xxh3Long* hash_base, int64_t hash_offset) {
  return dispatch(width, xor_values, [&](auto ops) {
    return ops.scan(base, next, n, positions, values, cap, hash_next, hash_base, hash_offset);
  });
}

void xxh3_long_init(Xxh3Long* st, int64_t len) {
  const uint64_t init[8] = {xxh3::kP32_3, xxh3::kP64_1, xxh3::kP64_2, xxh3::kP64_3,
                            xxh3::kP64_4, xxh3::kP32_2, xxh3::kP64_5, xxh3::kP32_1};
  std::memcpy(st->acc, init, sizeof(init));
  st->len = len;
}

void xxh3_long_update(Xxh3Long* st, const uint8_t* data, int64_t offset, int64_t bytes) {
#ifdef MILES_X86
  if (g_isa == Isa::kAvx512) return hash_avx512(st, data, offset, bytes);
  if (g_isa == Isa::kAvx2) return hash_avx2(st, data, offset, bytes);
#endif
  hash_scalar(st, data, offset, bytes);
}

namespace {
uint64_t avalanche(uint64_t h) {
  h ^= h >> 37;
  h *= xxh3::kMix;
  return h ^ (h >> 32);
}

uint64_t merge(const uint64_t* acc, const uint8_t* key, uint64_t start) {
  uint64_t r = start;
  for (int i = 0; i < 4; ++i) {
    const unsigned __int128 p =
        static_cast<unsigned __int128>(acc[2 * i] ^ xxh3::read64(key + 16 * i)) *
        (acc[2 * i + 1] ^ xxh3::read64(key + 16 * i + 8));
    r += static_cast<uint64_t>(p) ^ static_cast<uint64_t>(p >> 64);
  }
  return avalanche(r);
}
}  // namespace

void xxh3_long_digest(const Xxh3Long* st, const uint8_t* input_end, uint64_t* high,
                      uint64_t* low) {
  uint64_t acc[8];
  std::memcpy(acc, st->acc, sizeof(acc));
  // The last 64 bytes, against the secret at kLastAt, without a scramble.
  const uint8_t* p = input_end - xxh3::kStripe;
  for (int i = 0; i < 8; ++i) {
    const uint64_t v = xxh3::read64(p + 8 * i);
    const uint64_t k = v ^ xxh3::read64(xxh3::kSecret + xxh3::kLastAt + 8 * i);
    acc[i ^ 1] += v;
    acc[i] += (k & 0xFFFFFFFFULL) * (k >> 32);
  }
  const uint64_t len = static_cast<uint64_t>(st->len);
  *low = merge(acc, xxh3::kSecret + xxh3::kMergeLowAt, len * xxh3::kP64_1);
  *high = merge(acc, xxh3::kSecret + xxh3::kMergeHighAt, ~(len * xxh3::kP64_2));
}

void pack_sparse(const int32_t* positions, const uint8_t* values, int64_t k, int width,
                 uint8_t* out) {
  dispatch(width, false, [&](auto ops) {
    ops.pack(positions, values, k, out);
    return 0;
  });
}

void dense_encode(const uint8_t* base, const uint8_t* next, int64_t n, int width, bool xor_values,
                  uint8_t* out) {
  dispatch(width, xor_values, [&](auto ops) {
    ops.planes(base, next, n, out);
    return 0;
  });
}

int sparse_apply(uint8_t* target, int64_t n, int width, const uint8_t* raw, int64_t k,
                 bool xor_values, int64_t* last_pos) {
  // Every gap is checked before anything is written. Scratch per thread, kept: a fresh
  // allocation would fault its pages in on every call.
  thread_local std::vector<int32_t> gaps;
  if (static_cast<int64_t>(gaps.size()) < k) gaps.resize(static_cast<size_t>(k));
  const int64_t last = unpack_gaps_isa(raw, k, gaps.data());
  if (last < 0) return kSparseNotIncreasing;
  *last_pos = k > 0 ? last : -1;
  if (k > 0 && last >= n) return kSparseOutOfRange;
  dispatch(width, xor_values, [&](auto ops) {
    ops.scatter(target, gaps.data(), raw + 4 * k, k);
    return 0;
  });
  return kSparseOk;
}

int apply_fused(uint8_t* target, const uint8_t* source, int64_t n, int width, int layout,
                const uint8_t* raw, int64_t k, bool xor_values, Xxh3Long* hash,
                int64_t hash_offset, int64_t* last_pos) {
  thread_local std::vector<int32_t> gaps;
  *last_pos = -1;
  if (layout == kLayoutSparse) {  // every gap checked before anything is written
    if (static_cast<int64_t>(gaps.size()) < k) gaps.resize(static_cast<size_t>(k));
    const int64_t last = unpack_gaps_isa(raw, k, gaps.data());
    if (last < 0) return kSparseNotIncreasing;
    *last_pos = k > 0 ? last : -1;
    if (k > 0 && last >= n) return kSparseOutOfRange;
  }
  // Sub-blocks small enough to stay in L1/L2 between the copy, the patch and the hash.
  constexpr int64_t kSub = 64 * 1024;
  const int64_t bytes = n * width;
  int64_t j = 0, pos = (layout == kLayoutSparse && k > 0) ? gaps[0] : 0;
  for (int64_t lo = 0; lo < bytes; lo += kSub) {
    const int64_t hi = lo + kSub < bytes ? lo + kSub : bytes;
    if (source != target) std::memcpy(target + lo, source + lo, static_cast<size_t>(hi - lo));
    if (layout == kLayoutSparse) {
      dispatch(width, xor_values, [&](auto ops) {
        ops.scatter_range(target, gaps.data(), raw + 4 * k, k, &j, &pos, hi / width);
        return 0;
      });
    } else if (layout == kLayoutDense) {
      dispatch(width, xor_values, [&](auto ops) {
        ops.unplanes_range(target, n, raw, lo / width, hi / width);
        return 0;
      });
    }
    if (hash) xxh3_long_update(hash, target + lo, hash_offset + lo, hi - lo);
  }
  return kSparseOk;
}

void dense_apply(uint8_t* target, int64_t n, int width, const uint8_t* raw, bool xor_values) {
  dispatch(width, xor_values, [&](auto ops) {
    ops.unplanes(target, n, raw);
    return 0;
  });
}

bool delta_use_isa(const char* name) {
  Isa want;
  if (std::strcmp(name, "avx512") == 0)
    want = Isa::kAvx512;
  else if (std::strcmp(name, "avx2") == 0)
    want = Isa::kAvx2;
  else if (std::strcmp(name, "generic") == 0)
    want = Isa::kGeneric;
  else
    return false;
  if (static_cast<int>(want) > static_cast<int>(kBest)) return false;
  g_isa = want;
  return true;
}

const char* delta_isa() {
  switch (g_isa) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "generic";
  }
}

}  // namespace miles_transfer
