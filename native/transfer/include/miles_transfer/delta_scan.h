// Disk-delta kernels: compare-and-compact and its inverse, torch-free, raw pointers and sizes.
//
// Elements are `width` bytes (1, 2, 4 or 8) compared as raw bits. The byte layout they produce
// and read is the one miles_transfer._delta_codec writes (the delta file format):
//
// - a sparse chunk of k changed elements is `k` int32 gaps (the first gap is the first changed
//   position, each next one the distance to the previous position), byte-shuffled (all first
//   bytes, then all second bytes, ...), then the k values (new ^ base for xor, new for
//   overwrite), byte-shuffled the same way;
// - a dense chunk is every element's value, byte-shuffled.
//
// Every function dispatches at run time to an AVX-512BW, an AVX2 or a portable version; all
// give the same bytes. Bounds are the caller's responsibility (the Python wrapper checks them).
#pragma once

#include <cstdint>

namespace miles_transfer {

// XXH3-128 (seed 0, default secret; the digest of xxhash's XXH3_128bits) of an input longer
// than 240 bytes, fed in pieces that start at multiples of 64 bytes.
struct Xxh3Long {
  uint64_t acc[8];
  int64_t len;  // bytes of the whole input
};

// Starts a digest of an input of `len` bytes (len > 240).
void xxh3_long_init(Xxh3Long* state, int64_t len);

// Feeds input bytes [offset, offset + bytes) (offset a multiple of 64; data points at byte
// `offset` of the input). Pieces must come in order, each starting where the last one ended.
void xxh3_long_update(Xxh3Long* state, const uint8_t* data, int64_t offset, int64_t bytes);

// The digest, once every byte was fed; `input_end` points one past the input's last byte (its
// last 64 bytes are read again). Writes the high and low 64-bit halves.
void xxh3_long_digest(const Xxh3Long* state, const uint8_t* input_end, uint64_t* high,
                      uint64_t* low);

// Compares base[0..n) with next[0..n) and, for each element whose bits differ (in order), writes
// its position to positions[k] and its value (next ^ base when xor_values, else next) to
// values[k * width ..], as long as all of them fit in `cap` entries; otherwise it only counts
// (the chunk is dense). Returns the number of changed elements (which may exceed cap).
// `positions` needs cap + 16 entries and `values` cap * width + 64 bytes: the vector code
// stores whole registers past the last entry. With `hash_next` / `hash_base` (either may be
// null), next's / base's bytes are fed to them as bytes [hash_offset, hash_offset + n * width)
// of their inputs in the same pass (both inputs of the same length; hash_offset a multiple
// of 64).
int64_t delta_scan(const uint8_t* base, const uint8_t* next, int64_t n, int width, bool xor_values,
                   int32_t* positions, uint8_t* values, int64_t cap,
                   Xxh3Long* hash_next = nullptr, Xxh3Long* hash_base = nullptr,
                   int64_t hash_offset = 0);

// The sparse layout of k changed elements from delta_scan's positions and values: the gaps'
// byte planes, then the values' byte planes ((4 + width) * k bytes at out).
void pack_sparse(const int32_t* positions, const uint8_t* values, int64_t k, int width,
                 uint8_t* out);

// The dense layout in one pass: out = shuffle(xor_values ? next ^ base : next), n elements.
void dense_encode(const uint8_t* base, const uint8_t* next, int64_t n, int width, bool xor_values,
                  uint8_t* out);

// Result codes of sparse_apply.
enum SparseStatus : int { kSparseOk = 0, kSparseNotIncreasing = 1, kSparseOutOfRange = 2 };

// Patches target[0..n) from a sparse chunk `raw` of k elements (the layout above; 4 * k + width *
// k bytes): target[pos] ^= value (xor) or target[pos] = value. The gaps are checked first
// (first >= 0, later ones > 0, last position < n); on a bad one nothing is written and the
// status says why. `last_pos` receives the last position (for the error message).
int sparse_apply(uint8_t* target, int64_t n, int width, const uint8_t* raw, int64_t k,
                 bool xor_values, int64_t* last_pos);

// Patches target[0..n) from a dense chunk `raw` (n * width bytes, shuffled): target ^= values
// (xor) or target = values.
void dense_apply(uint8_t* target, int64_t n, int width, const uint8_t* raw, bool xor_values);

// Chunk layouts for apply_fused.
enum ChunkLayout : int { kLayoutNone = 0, kLayoutSparse = 1, kLayoutDense = 2 };

// One pass over a chunk of the result: target = source (copied unless they are the same
// memory), patched by the chunk (kLayoutSparse: raw holds k elements; kLayoutDense: n; None:
// unchanged), and the result's bytes fed to `hash` (may be null) as bytes [hash_offset,
// hash_offset + n * width) of its input. Works in sub-blocks that stay in cache between the
// three steps. A sparse chunk's gaps are checked first (status as for sparse_apply; nothing
// written on a bad one).
int apply_fused(uint8_t* target, const uint8_t* source, int64_t n, int width, int layout,
                const uint8_t* raw, int64_t k, bool xor_values, Xxh3Long* hash,
                int64_t hash_offset, int64_t* last_pos);

// Which implementation the dispatch uses: "avx512", "avx2" or "generic".
const char* delta_isa();

// Uses `name` ("avx512", "avx2" or "generic") from now on, if this CPU supports it (returns
// false and changes nothing otherwise). For tests: every implementation gives the same bytes.
// Not thread-safe: call it while no kernel runs.
bool delta_use_isa(const char* name);

}  // namespace miles_transfer
