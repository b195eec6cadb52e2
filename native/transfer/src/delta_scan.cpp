// Disk-delta kernels (see include/miles_transfer/delta_scan.h).
//
// delta_scan reads base and next once, 64 bytes at a time: a byte-inequality mask of the block
// (one AVX-512BW compare, two AVX2 compares, or eight 64-bit xors), folded to one bit per
// element, is usually zero; for the few set bits the gap and value are written out. The rest
// are plain loops over the k changed elements, or over byte planes, which are short or rare
// (dense chunks) at the change rates of an RL step.
#include "miles_transfer/delta_scan.h"

#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define MILES_X86 1
#endif

namespace miles_transfer {
namespace {

constexpr int64_t kBlock = 64;  // bytes compared per step

template <int W>
inline uint64_t load_elem(const uint8_t* p) {
  uint64_t v = 0;
  std::memcpy(&v, p, W);  // little-endian hosts only (x86, arm64): the bytes as stored
  return v;
}

template <int W>
inline void store_elem(uint8_t* p, uint64_t v) {
  std::memcpy(p, &v, W);
}

// One bit per element (at its first byte) from a mask of differing bytes.
template <int W>
inline uint64_t fold(uint64_t m) {
  if (W == 1) return m;
  if (W == 2) return (m | (m >> 1)) & 0x5555555555555555ULL;
  m |= m >> 1;
  m |= m >> 2;
  if (W == 4) return m & 0x1111111111111111ULL;
  m |= m >> 4;
  return m & 0x0101010101010101ULL;
}

// Byte-inequality mask of one 64-byte block, portable: bit b set iff a[b] != b[b].
inline uint64_t block_mask_generic(const uint8_t* a, const uint8_t* b) {
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

#ifdef MILES_X86
__attribute__((target("avx2"))) inline uint64_t block_mask_avx2(const uint8_t* a,
                                                                 const uint8_t* b) {
  const __m256i a0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
  const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
  const __m256i a1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 32));
  const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32));
  const uint32_t eq0 = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi8(a0, b0)));
  const uint32_t eq1 = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi8(a1, b1)));
  return ~(static_cast<uint64_t>(eq0) | (static_cast<uint64_t>(eq1) << 32));
}

__attribute__((target("avx512f,avx512bw"))) inline uint64_t block_mask_avx512(const uint8_t* a,
                                                                               const uint8_t* b) {
  return _cvtmask64_u64(_mm512_cmpneq_epu8_mask(_mm512_loadu_si512(a), _mm512_loadu_si512(b)));
}
#endif

// Writes the gaps and values of the elements flagged in `em` (bits at element starts of the
// block at byte offset `off`); counts only once `cap` entries are written.
template <int W, bool XOR>
struct Emitter {
  const uint8_t* base;
  const uint8_t* next;
  int32_t* gaps;
  uint8_t* values;
  int64_t cap;
  int64_t k = 0;
  int64_t prev = 0;

  inline void emit(uint64_t em, int64_t off) {
    if (k >= cap) {
      k += __builtin_popcountll(em);
      return;
    }
    while (em) {
      const int b = __builtin_ctzll(em);
      em &= em - 1;
      if (k < cap) {
        const int64_t byte = off + b;
        const int64_t pos = byte / W;
        gaps[k] = static_cast<int32_t>(pos - prev);
        prev = pos;
        uint64_t v = load_elem<W>(next + byte);
        if (XOR) v ^= load_elem<W>(base + byte);
        store_elem<W>(values + k * W, v);
      }
      ++k;
    }
  }
};

// The scan loop, instantiated per element width, value kind and block-mask implementation.
#define MILES_DEFINE_SCAN(NAME, ATTR, MASK)                                                     \
  template <int W, bool XOR>                                                                    \
  ATTR int64_t NAME(const uint8_t* base, const uint8_t* next, int64_t n, int32_t* gaps,         \
                    uint8_t* values, int64_t cap) {                                             \
    Emitter<W, XOR> e{base, next, gaps, values, cap};                                           \
    const int64_t bytes = n * W;                                                                \
    const int64_t full = bytes - bytes % kBlock;                                                \
    for (int64_t off = 0; off < full; off += kBlock) {                                          \
      const uint64_t m = MASK(base + off, next + off);                                          \
      if (m) e.emit(fold<W>(m), off);                                                           \
    }                                                                                           \
    if (full < bytes) { /* the tail, zero-padded: padding never differs */                      \
      uint8_t a[kBlock] = {0}, b[kBlock] = {0};                                                 \
      std::memcpy(a, base + full, static_cast<size_t>(bytes - full));                           \
      std::memcpy(b, next + full, static_cast<size_t>(bytes - full));                           \
      const uint64_t m = block_mask_generic(a, b);                                              \
      if (m) e.emit(fold<W>(m), full);                                                          \
    }                                                                                           \
    return e.k;                                                                                 \
  }

MILES_DEFINE_SCAN(scan_generic, , block_mask_generic)
#ifdef MILES_X86
MILES_DEFINE_SCAN(scan_avx2, __attribute__((target("avx2"))), block_mask_avx2)
MILES_DEFINE_SCAN(scan_avx512, __attribute__((target("avx512f,avx512bw"))), block_mask_avx512)
#endif
#undef MILES_DEFINE_SCAN

enum class Isa { kGeneric, kAvx2, kAvx512 };

Isa detect() {
#ifdef MILES_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"))
    return Isa::kAvx512;
  if (__builtin_cpu_supports("avx2")) return Isa::kAvx2;
#endif
  return Isa::kGeneric;
}

const Isa kBest = detect();
Isa g_isa = kBest;  // set once at load; delta_use_isa may lower it (tests)

template <int W, bool XOR>
int64_t scan(const uint8_t* base, const uint8_t* next, int64_t n, int32_t* gaps, uint8_t* values,
             int64_t cap) {
#ifdef MILES_X86
  if (g_isa == Isa::kAvx512) return scan_avx512<W, XOR>(base, next, n, gaps, values, cap);
  if (g_isa == Isa::kAvx2) return scan_avx2<W, XOR>(base, next, n, gaps, values, cap);
#endif
  return scan_generic<W, XOR>(base, next, n, gaps, values, cap);
}

// Byte planes of (next ^ base) or next; base unused when !XOR.
template <int W, bool XOR>
void planes(const uint8_t* base, const uint8_t* next, int64_t n, uint8_t* out) {
  for (int64_t i = 0; i < n; ++i) {
    uint64_t v = load_elem<W>(next + i * W);
    if (XOR) v ^= load_elem<W>(base + i * W);
    for (int j = 0; j < W; ++j) out[j * n + i] = static_cast<uint8_t>(v >> (8 * j));
  }
}

template <int W>
inline uint64_t gather(const uint8_t* raw, int64_t n, int64_t i) {
  uint64_t v = 0;
  for (int j = 0; j < W; ++j) v |= static_cast<uint64_t>(raw[j * n + i]) << (8 * j);
  return v;
}

template <int W, bool XOR>
void unplanes(uint8_t* target, int64_t n, const uint8_t* raw) {
  for (int64_t i = 0; i < n; ++i) {
    uint64_t v = gather<W>(raw, n, i);
    if (XOR) v ^= load_elem<W>(target + i * W);
    store_elem<W>(target + i * W, v);
  }
}

template <int W, bool XOR>
void scatter(uint8_t* target, const uint8_t* raw, int64_t k) {
  const uint8_t* vals = raw + 4 * k;
  int64_t pos = 0;
  for (int64_t i = 0; i < k; ++i) {
    pos += static_cast<int32_t>(gather<4>(raw, k, i));
    uint64_t v = gather<W>(vals, k, i);
    if (XOR) v ^= load_elem<W>(target + pos * W);
    store_elem<W>(target + pos * W, v);
  }
}

// Calls F<W, XOR>::run(args...) for a run-time width and value kind.
template <template <int, bool> class F, typename... A>
auto by_width(int width, bool xor_values, A... args) {
  switch (width * 2 + (xor_values ? 1 : 0)) {
    case 2: return F<1, false>::run(args...);
    case 3: return F<1, true>::run(args...);
    case 4: return F<2, false>::run(args...);
    case 5: return F<2, true>::run(args...);
    case 8: return F<4, false>::run(args...);
    case 9: return F<4, true>::run(args...);
    case 16: return F<8, false>::run(args...);
    default: return F<8, true>::run(args...);
  }
}

template <int W, bool XOR>
struct ScanOp {
  static int64_t run(const uint8_t* b, const uint8_t* x, int64_t n, int32_t* g, uint8_t* v,
                     int64_t cap) {
    return scan<W, XOR>(b, x, n, g, v, cap);
  }
};
template <int W, bool XOR>
struct PlanesOp {
  static int run(const uint8_t* b, const uint8_t* x, int64_t n, uint8_t* out) {
    planes<W, XOR>(b, x, n, out);
    return 0;
  }
};
template <int W, bool XOR>
struct UnplanesOp {
  static int run(uint8_t* t, int64_t n, const uint8_t* raw) {
    unplanes<W, XOR>(t, n, raw);
    return 0;
  }
};
template <int W, bool XOR>
struct ScatterOp {
  static int run(uint8_t* t, const uint8_t* raw, int64_t k) {
    scatter<W, XOR>(t, raw, k);
    return 0;
  }
};

}  // namespace

int64_t delta_scan(const uint8_t* base, const uint8_t* next, int64_t n, int width, bool xor_values,
                   int32_t* gaps, uint8_t* values, int64_t cap) {
  return by_width<ScanOp>(width, xor_values, base, next, n, gaps, values, cap);
}

void shuffle_bytes(const uint8_t* in, int64_t k, int width, uint8_t* out) {
  by_width<PlanesOp>(width, false, static_cast<const uint8_t*>(nullptr), in, k, out);
}

void dense_encode(const uint8_t* base, const uint8_t* next, int64_t n, int width, bool xor_values,
                  uint8_t* out) {
  by_width<PlanesOp>(width, xor_values, base, next, n, out);
}

int sparse_apply(uint8_t* target, int64_t n, int width, const uint8_t* raw, int64_t k,
                 bool xor_values, int64_t* last_pos) {
  // Check every gap before writing anything.
  int64_t pos = 0;
  for (int64_t i = 0; i < k; ++i) {
    const int32_t g = static_cast<int32_t>(gather<4>(raw, k, i));
    if (g < 0 || (i > 0 && g == 0)) return kSparseNotIncreasing;
    pos += g;
  }
  *last_pos = k > 0 ? pos : -1;
  if (k > 0 && pos >= n) return kSparseOutOfRange;
  by_width<ScatterOp>(width, xor_values, target, raw, k);
  return kSparseOk;
}

void dense_apply(uint8_t* target, int64_t n, int width, const uint8_t* raw, bool xor_values) {
  by_width<UnplanesOp>(width, xor_values, target, n, raw);
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
