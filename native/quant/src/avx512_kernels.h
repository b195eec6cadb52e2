// AVX-512 leaf kernels: the same per-group arithmetic as cpu_kernels.h, 16 fp32 lanes at a time.
//
// Included by avx512_leaf.h (cpu_isa_avx512.cpp, compiled with -mavx512f/bw/vl/dq, and
// cpu_isa_avx512vbmi.cpp, with -mavx512vbmi too), after cpu_kernels.h, inside namespace
// miles_quant::cpu::MQ_CPU_NS. Every vector step is the lane-wise twin of a scalar
// step of the contract: element encoding is the round-to-nearest-even of bits.h/elements.h on
// 32-bit lanes (integer for normal targets, one exact fp32 addition for subnormal ones, see
// encode; E2M1 in the quantizers by one fp32 addition onto its grid, see e2m1_magnitude),
// divisions and multiplications are single IEEE fp32 operations (vdivps / vmulps,
// exact like their scalar forms; no FMA, no reciprocal estimate), and scales follow contract.h
// operation for operation, for 16 groups at a time: their amaxes come out of one transposing
// reduction (reduce16), and whole batches of 16 blocks take unmasked paths. Tails run through
// masked loads (zero lanes never change an amax and encode to the pad code) and masked stores,
// so no byte outside a row is touched. Large inputs are streamed with software prefetches and
// in two to four interleaved streams (see kPrefetchAhead): that changes the order in which
// groups are visited, never their arithmetic. The tests compare this path with the AVX2 and generic
// builds of the scalar code and with the PyTorch reference bit for bit.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <iterator>
#include <type_traits>

namespace miles_quant {
namespace cpu {
namespace MQ_CPU_NS {

#include "avx512_simd.h"   // simd::, block amax reductions, prefetch_lines
#include "avx512_fp8.h"    // fp8_flat_v, fp8_tiles_v
#include "avx512_mx.h"     // e2m1_code, mx_rows_v
#include "avx512_nvfp4.h"  // nvfp4_rows_v
#include "avx512_int4.h"   // int4_rows_v
#include "avx512_dequant.h"  // dequant_rows_v

// ---- raw casts and amax ---------------------------------------------------------------------

template <class F>
static void encode_run_v(const float* x, int64_t n, uint8_t* out) {
  for (int64_t i = 0; i < n; i += 16) {
    const simd::Mask m = simd::tail_mask(n - i);
    const __m512 v = _mm512_maskz_loadu_ps(m, x + i);
    if constexpr (F::kEbits + F::kMbits == 3) {
      // The quantizers' E2M1 encoding (e2m1_code), so that the element tests check it on raw
      // values; NaN (which quantizers never encode) becomes +0 as the contract says.
      const simd::Mask nan = _mm512_cmpgt_epu32_mask(simd::abs_bits(v), simd::u32(kF32InfBits));
      simd::store_bytes(out + i, _mm512_maskz_mov_epi32(static_cast<simd::Mask>(~nan), e2m1_code(v)), m);
    } else {
      simd::store_bytes(out + i, simd::encode<F, true>(v), m);
    }
  }
}

}  // namespace MQ_CPU_NS
}  // namespace cpu
}  // namespace miles_quant
