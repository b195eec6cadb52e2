// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78): SSE4.2 crc32 instructions on x86-64,
// a slicing-by-8 table elsewhere. Both give the same values (crc32c(0, "123456789") = 0xE3069283).
#include <array>
#include <cstring>

#include "miles_offload/pager.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <nmmintrin.h>
#define MO_X86 1
#endif

namespace miles_offload {

namespace {

using Table = std::array<std::array<uint32_t, 256>, 8>;

Table make_table() {
  Table t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
    t[0][i] = c;
  }
  for (uint32_t i = 0; i < 256; ++i) {
    for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
  }
  return t;
}

uint32_t crc_table(uint32_t c, const unsigned char* p, std::size_t n) {
  static const Table t = make_table();
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    w ^= c;
    c = t[7][w & 0xFF] ^ t[6][(w >> 8) & 0xFF] ^ t[5][(w >> 16) & 0xFF] ^ t[4][(w >> 24) & 0xFF] ^
        t[3][(w >> 32) & 0xFF] ^ t[2][(w >> 40) & 0xFF] ^ t[1][(w >> 48) & 0xFF] ^ t[0][w >> 56];
    p += 8;
    n -= 8;
  }
  while (n--) c = (c >> 8) ^ t[0][(c ^ *p++) & 0xFF];
  return c;
}

#ifdef MO_X86
__attribute__((target("sse4.2"))) uint32_t crc_hw(uint32_t c, const unsigned char* p,
                                                   std::size_t n) {
  uint64_t c64 = c;
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    c64 = _mm_crc32_u64(c64, w);
    p += 8;
    n -= 8;
  }
  uint32_t c32 = static_cast<uint32_t>(c64);
  while (n--) c32 = _mm_crc32_u8(c32, *p++);
  return c32;
}
#endif

}  // namespace

uint32_t crc32c(uint32_t crc, const void* data, std::size_t len) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = ~crc;
#ifdef MO_X86
  static const bool hw = __builtin_cpu_supports("sse4.2");
  c = hw ? crc_hw(c, p, len) : crc_table(c, p, len);
#else
  c = crc_table(c, p, len);
#endif
  return ~c;
}

}  // namespace miles_offload
