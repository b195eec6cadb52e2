// Exhaustive proof behind miles-quant's INT4 mantissa tables (native/quant/src/
// avx512_int4_tables.h, the AVX512-VBMI build), against int4_rows_v's fp32 path (int4_codes: a
// vdivps against the stored scale, itself tested against the PyTorch reference):
// 1. the element routine int4_tab64, for every table of every scale dtype, every scale exponent
//    field 2..254 and every finite bf16 input (two tables and exponents per 64-lane step);
// 2. int4_tab_groups, for every bf16 group amax that is not poisoned (0 included, so the 1e-5
//    clamp too), every bf16 input x with |x| <= amax (both signs; what a group with that amax
//    can hold), every scale dtype (f32, bf16, f16) and both group sizes (32, 128), in batches of
//    16 groups that interleave two amax streams (so that groups of 32 sharing a step have
//    different tables and exponents); the groups it leaves to the fp32 path must be fp16 ones;
// 3. int4_rows_v as a whole (tables and fallbacks, row tails, poisoned groups, tiny and huge
//    groups) against the scalar contract (int4_rows_t) on random matrices.
// Then times both element paths in L1. Run by tests/test_quant_int4_tables.py; by hand:
//
//   g++ -O2 -std=c++17 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vbmi \
//       -ffp-contract=off -Inative/quant/include -Inative/quant/src \
//       tools/bench/quant_int4_tables_probe.cpp -o /tmp/int4probe && /tmp/int4probe
#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>
#define MQ_CPU_NS avx512vbmi
#include "miles_quant/cpu_kernels.h"
#include "avx512_kernels.h"
using namespace miles_quant;
using namespace miles_quant::cpu::avx512vbmi;

static_assert(kInt4Tables, "compile with -mavx512vbmi");

static const DType kScaleDtypes[3] = {DType::f32, DType::bf16, DType::f16};
static const char* const kScaleNames[3] = {"f32", "bf16", "f16"};

// int4_rows_v's fp32 path for one whole bf16 group of g (a multiple of 32) with stored scale s.
static void fp32_group(const uint16_t* x, int64_t g, __m512 s, uint8_t* out) {
  for (int64_t i = 0; i < g; i += 32) {
    __m512 ev, od;
    simd::load_bf16_pairs(x + i, &ev, &od);
    simd::store_nibble_pairs(out + i / 2, int4_codes(ev, s), int4_codes(od, s));
  }
}

// int4_tab64 for every table of every scale dtype (two per step: lanes 0-31 and 32-63 take
// different tables and exponents) at every scale exponent field E in [2, 254] (the byte c = E - 2
// holds them; stored scales have E in [110, 252]) and every finite bf16 input x (a group that
// holds an Inf or a NaN is poisoned and never reaches the tables), against the fp32 lanes with
// s = the table's significand at exponent E: a table gives the codes of any such scale,
// whichever group amax chose it.
static uint64_t check_routine(uint64_t* checked) {
  std::vector<uint16_t> xs;
  for (uint32_t b = 0; b < 65536; ++b)
    if ((b & 0x7FFFu) < 0x7F80u) xs.push_back(static_cast<uint16_t>(b));  // all but Inf and NaN
  while (xs.size() % 64) xs.push_back(0);
  const int64_t n = static_cast<int64_t>(xs.size());
  std::vector<uint8_t> want(n / 2), got(n / 2);
  uint64_t bad = 0;
  for (int sdi = 0; sdi < 3; ++sdi) {
    const Int4Tables& t = int4_tables(kScaleDtypes[sdi]);
    for (uint32_t i = 0; i < 129; ++i) {
      const uint32_t i2 = (i * 37 + 11) % 129;  // a bijection: every table also serves lanes 32-63
      const __m512i a0 = _mm512_load_si512(t.t[i]), a1 = _mm512_load_si512(t.t[i] + 64);
      const __m512i b0 = _mm512_load_si512(t.t[i2]), b1 = _mm512_load_si512(t.t[i2] + 64);
      for (uint32_t e = 2; e <= 254; ++e) {
        const uint32_t e2 = 2 + (7 * e) % 253;  // likewise for the exponents
        const __m512 s = _mm512_set1_ps(bits_f32(t.sig[i] | (e << 23))), s2 = _mm512_set1_ps(bits_f32(t.sig[i2] | (e2 << 23)));
        const __m512i c = _mm512_mask_blend_epi8(0xFFFFFFFF00000000ull, _mm512_set1_epi8(static_cast<char>(e - 2)),
                                                 _mm512_set1_epi8(static_cast<char>(e2 - 2)));
        for (int64_t j = 0; j < n; j += 64) {
          __m512 ev, od;
          simd::load_bf16_pairs(&xs[j], &ev, &od);
          simd::store_nibble_pairs(&want[j / 2], int4_codes(ev, s), int4_codes(od, s));
          simd::load_bf16_pairs(&xs[j + 32], &ev, &od);
          simd::store_nibble_pairs(&want[j / 2 + 16], int4_codes(ev, s2), int4_codes(od, s2));
          const __m256i r = int4_tab64<true>(_mm512_loadu_si512(&xs[j]), _mm512_loadu_si512(&xs[j + 32]), a0, a1, b0, b1, c);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(&got[j / 2]), r);
        }
        *checked += static_cast<uint64_t>(n);
        if (std::memcmp(want.data(), got.data(), static_cast<size_t>(n / 2)) == 0) continue;
        for (int64_t b = 0; b < n / 2; ++b) {
          if (want[b] == got[b]) continue;
          bad += ((want[b] ^ got[b]) & 0x0F ? 1 : 0) + ((want[b] ^ got[b]) & 0xF0 ? 1 : 0);
          if (bad <= 10) {
            const bool upper = (b % 32) >= 16;
            std::printf("scales %s table %u E %u inputs %04x %04x: fp32 path %02x, tables %02x\n", kScaleNames[sdi],
                        upper ? i2 : i, upper ? e2 : e, xs[2 * b], xs[2 * b + 1], want[b], got[b]);
          }
        }
      }
    }
  }
  return bad;
}

// The groups of g inputs holding every bf16 x with |x| <= amax, both signs, for the amaxes of
// positions [i, end) of a fixed shuffle of the 32,640 finite bf16 amaxes (each amax's last group
// padded with zeros): two streams over the two halves, their groups interleaved, put unrelated
// amaxes (tables, exponents, and with fp16 scales groups the tables take or leave) side by side.
constexpr uint32_t kAmaxes = 0x7F80;
struct Stream {
  uint32_t i, end;
  int64_t pos = 0;
  uint32_t ab() const { return static_cast<uint32_t>(i * uint64_t{7919} % kAmaxes); }  // 7919: prime, coprime to kAmaxes
  bool next(int64_t g, uint16_t* x, uint32_t* amax) {
    if (i == end) return false;
    const int64_t count = 2 * (static_cast<int64_t>(ab()) + 1);
    for (int64_t k = 0; k < g; ++k) {
      const int64_t j = pos + k;
      x[k] = j < count ? static_cast<uint16_t>((j >> 1) | ((j & 1) << 15)) : 0;
    }
    *amax = ab() << 16;
    pos += g;
    if (pos >= count) {
      pos = 0;
      ++i;
    }
    return true;
  }
};

struct Counts {
  uint64_t checked = 0, bad = 0, fallback_groups = 0, groups = 0;
};

static void check_exhaustive(int sdi, int64_t g, Counts* c) {
  const DType sd = kScaleDtypes[sdi];
  Stream up{0, kAmaxes / 2}, down{kAmaxes / 2, kAmaxes};
  std::vector<uint16_t> x(16 * g);
  std::vector<uint8_t> want(8 * g), got(8 * g);
  alignas(64) uint32_t amax[16];
  alignas(64) float s[16];
  uint32_t scratch[16];
  for (;;) {
    int64_t nb = 0;
    for (int64_t k = 0; k < 16; ++k) {
      Stream& first = (k & 1) ? down : up;
      Stream& second = (k & 1) ? up : down;
      if (first.next(g, &x[nb * g], &amax[nb]) || second.next(g, &x[nb * g], &amax[nb])) ++nb;
    }
    if (nb == 0) break;
    for (int64_t k = nb; k < 16; ++k) amax[k] = 0;
    const __m512i av = _mm512_load_si512(amax);
    const __m512 sv = int4_store_scales(av, 0, sd, scratch, nb);
    _mm512_store_ps(s, sv);
    for (int64_t k = 0; k < nb; ++k) fp32_group(&x[k * g], g, _mm512_set1_ps(s[k]), &want[k * g / 2]);
    std::memset(got.data(), 0xEE, got.size());
    const simd::Mask done = int4_tab_groups(x.data(), nb * g, g, nb, av, sv, 0, sd, got.data());
    for (int64_t k = 0; k < nb; ++k) {
      ++c->groups;
      if (!((done >> k) & 1)) {
        ++c->fallback_groups;
        continue;
      }
      c->checked += static_cast<uint64_t>(g);
      for (int64_t b = k * g / 2; b < (k + 1) * g / 2; ++b) {
        if (want[b] == got[b]) continue;
        c->bad += ((want[b] ^ got[b]) & 0x0F ? 1 : 0) + ((want[b] ^ got[b]) & 0xF0 ? 1 : 0);
        if (c->bad <= 10)
          std::printf("scales %s g %lld amax %04x inputs %04x %04x: fp32 path %02x, tables %02x\n", kScaleNames[sdi],
                      static_cast<long long>(g), amax[k] >> 16, x[2 * b], x[2 * b + 1], want[b], got[b]);
      }
    }
    if (done >> nb) {
      std::printf("int4_tab_groups claims groups past nb\n");
      ++c->bad;
    }
  }
}

// A random bf16 matrix whose groups of 32 have varied magnitudes (a random power of two each, so
// that neighbours take different tables and scales span the fp16 subnormal and saturated
// ranges), with a few poisoned groups, zero groups and subnormals.
static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint32_t rnd() {
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return static_cast<uint32_t>(rng_state >> 11);
}
static void random_matrix(int64_t R, int64_t C, std::vector<uint16_t>* x) {
  x->resize(R * C);
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t j = 0; j < C; j += 32) {
      const uint32_t kind = rnd() % 64;
      const uint32_t e = kind < 4 ? rnd() % 16 : (kind < 8 ? 250 + rnd() % 4 : 90 + rnd() % 70);  // tiny, huge, typical
      for (int64_t i = j; i < j + 32 && i < C; ++i) {
        uint32_t h = ((e - rnd() % 8) << 7) | (rnd() & 0x7F) | ((rnd() & 1) << 15);
        if (kind == 8) h &= 0x8000;  // a zero group
        (*x)[r * C + i] = static_cast<uint16_t>(h);
      }
      if (kind == 9) (*x)[r * C + j] = static_cast<uint16_t>(rnd() & 1 ? 0x7F80 : 0xFFC1);  // Inf, NaN
    }
  }
}

static uint64_t check_rows(uint64_t* checked) {
  uint64_t bad = 0;
  const int64_t shapes[][2] = {{64, 4096}, {33, 4000}, {17, 1056}, {9, 31}, {5, 96}, {3, 7168}, {7, 160}};
  for (const auto& shape : shapes) {
    const int64_t R = shape[0], C = shape[1];
    std::vector<uint16_t> x;
    random_matrix(R, C, &x);
    for (int64_t g : {32, 128}) {
      for (int sdi = 0; sdi < 3; ++sdi) {
        const int64_t ng = (C + g - 1) / g, ob = R * ((C + 1) / 2), sbytes = R * ng * 4;
        std::vector<uint8_t> out_v(ob, 0xEE), out_t(ob, 0xEE), sc_v(sbytes, 0xEE), sc_t(sbytes, 0xEE);
        Int4Args a{x.data(), DType::bf16, R, C, g, kScaleDtypes[sdi], out_v.data(), sc_v.data(), 1};
        int4_rows_v<DType::bf16>(a, 0, R);
        a.out = out_t.data();
        a.scales = sc_t.data();
        int4_rows_t<DType::bf16>(a, 0, R);
        *checked += static_cast<uint64_t>(R * C);
        for (int64_t i = 0; i < ob; ++i) {
          if (out_v[i] != out_t[i] && bad++ < 10)
            std::printf("rows %lldx%lld g %lld scales %s byte %lld: contract %02x, int4_rows_v %02x\n",
                        static_cast<long long>(R), static_cast<long long>(C), static_cast<long long>(g),
                        kScaleNames[sdi], static_cast<long long>(i), out_t[i], out_v[i]);
        }
        if (std::memcmp(sc_v.data(), sc_t.data(), static_cast<size_t>(sbytes)) != 0 && bad++ < 10)
          std::printf("rows %lldx%lld g %lld scales %s: scales differ\n", static_cast<long long>(R),
                      static_cast<long long>(C), static_cast<long long>(g), kScaleNames[sdi]);
      }
    }
  }
  return bad;
}

// Both element paths on one row of 4096 moderate inputs (in L1), 16 groups a batch, bf16 scales.
static void time_l1(int64_t g) {
  constexpr int64_t kN = 4096;
  std::vector<uint16_t> x(kN);
  for (int64_t i = 0; i < kN; ++i) x[i] = static_cast<uint16_t>(0x3f00 + (i * 37 % 300) + ((i & 1) << 15));
  std::vector<uint8_t> out(kN / 2);
  const int64_t batches = kN / (16 * g);  // at most 8
  __m512i amax[8];
  __m512 sv[8];
  uint16_t scratch[16];
  for (int64_t b = 0; b < batches; ++b) {
    alignas(64) uint32_t m[16];
    for (int64_t k = 0; k < 16; ++k) m[k] = static_cast<uint32_t>(In<DType::bf16>::amax_bits(&x[(16 * b + k) * g], g));
    amax[b] = _mm512_load_si512(m);
    sv[b] = int4_store_scales(amax[b], 0, DType::bf16, scratch, 16);
  }
  constexpr int kReps = 20000;
  for (int r = 0; r < 3; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int k = 0; k < kReps; ++k) {
      for (int64_t b = 0; b < batches; ++b)
        for (int64_t j = 0; j < 16; ++j)
          fp32_group(&x[(16 * b + j) * g], g, simd::lane(sv[b], static_cast<int>(j)), &out[(16 * b + j) * g / 2]);
      asm volatile("" ::: "memory");
    }
    const auto t1 = std::chrono::steady_clock::now();
    for (int k = 0; k < kReps; ++k) {
      for (int64_t b = 0; b < batches; ++b)
        int4_tab_groups(&x[16 * b * g], 16 * g, g, 16, amax[b], sv[b], 0, DType::bf16, &out[16 * b * g / 2]);
      asm volatile("" ::: "memory");
    }
    const auto t2 = std::chrono::steady_clock::now();
    const double n = static_cast<double>(kN) * kReps;
    std::printf("int4 g%lld elements in L1: fp32 path %.3f ns/el, tables %.3f ns/el\n", static_cast<long long>(g),
                std::chrono::duration<double, std::nano>(t1 - t0).count() / n,
                std::chrono::duration<double, std::nano>(t2 - t1).count() / n);
  }
}

int main() {
  uint64_t routine_checked = 0;
  const uint64_t routine_bad = check_routine(&routine_checked);
  std::printf("int4_tab64: %llu mismatching elements of %llu (every table x scale exponent 2..254 x finite bf16 input)\n",
              static_cast<unsigned long long>(routine_bad), static_cast<unsigned long long>(routine_checked));
  uint64_t bad = 0, checked = 0, misses = 0;
  for (int sdi = 0; sdi < 3; ++sdi) {
    for (int64_t g : {32, 128}) {
      Counts c;
      check_exhaustive(sdi, g, &c);
      std::printf("scales %s g %lld: %llu of %llu groups to the fp32 path\n", kScaleNames[sdi], static_cast<long long>(g),
                  static_cast<unsigned long long>(c.fallback_groups), static_cast<unsigned long long>(c.groups));
      if (kScaleDtypes[sdi] != DType::f16) misses += c.fallback_groups;  // f32 and bf16 scales always fit
      bad += c.bad;
      checked += c.checked;
    }
  }
  std::printf("mismatching elements: %llu of %llu (every bf16 amax x every |x| <= amax, 3 scale dtypes, g 32 and 128)\n",
              static_cast<unsigned long long>(bad), static_cast<unsigned long long>(checked));
  uint64_t row_checked = 0;
  const uint64_t row_bad = check_rows(&row_checked);
  std::printf("int4_rows_v against the contract: %llu mismatching bytes or scale rows, %llu elements\n",
              static_cast<unsigned long long>(row_bad), static_cast<unsigned long long>(row_checked));
  time_l1(128);
  time_l1(32);
  return routine_bad == 0 && bad == 0 && misses == 0 && row_bad == 0 ? 0 : 1;
}
