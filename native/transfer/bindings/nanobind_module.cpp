// The one binding file: miles_transfer._ext, a thin nanobind layer over copy_jobs (re-sharding)
// and the disk-delta kernels (delta_scan.h).
//
// `copy(jobs, threads)` takes an int64 array of shape [n, 3 + 3 * kMaxDims]: per job the source
// address, the destination address, ndim, then shape, source strides and destination strides
// (bytes, kMaxDims slots each). The Python wrapper (miles_transfer._reshard) builds the array
// from tensors it keeps alive and checks every box against its tensor's bounds; this layer
// checks the array's form. The copy runs without the GIL.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "miles_transfer/delta_scan.h"
#include "miles_transfer/strided_copy.h"

namespace nb = nanobind;
using namespace miles_transfer;

using I64 = nb::ndarray<int64_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

namespace {

// The delta kernels take tensor addresses as integers (the Python wrapper, miles_transfer.
// _delta_native, owns the tensors and checks every size); this layer checks the scalars.
template <typename T>
T* ptr(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

void check_width_len(int width, int64_t n, const char* what) {
  if (width != 1 && width != 2 && width != 4 && width != 8)
    throw std::invalid_argument(std::string("miles_transfer._ext.") + what +
                                ": width must be 1, 2, 4 or 8");
  if (n < 0) throw std::invalid_argument(std::string("miles_transfer._ext.") + what + ": n < 0");
}

}  // namespace

NB_MODULE(_ext, m) {
  m.doc() = "miles_transfer native strided copies (see miles_transfer/_reshard.py)";
  m.attr("MAX_DIMS") = kMaxDims;
  m.def(
      "copy",
      [](I64 desc, int threads) {
        const int64_t width = 3 + 3 * kMaxDims;
        if (desc.shape(1) != static_cast<size_t>(width))
          throw std::invalid_argument("miles_transfer._ext.copy: descriptor rows must have " +
                                      std::to_string(width) + " entries");
        const int64_t n = static_cast<int64_t>(desc.shape(0));
        const int64_t* d = desc.data();
        std::vector<Job> jobs(static_cast<size_t>(n));
        for (int64_t i = 0; i < n; ++i) {
          const int64_t* row = d + i * width;
          Job& j = jobs[static_cast<size_t>(i)];
          j.src = reinterpret_cast<const uint8_t*>(static_cast<uintptr_t>(row[0]));
          j.dst = reinterpret_cast<uint8_t*>(static_cast<uintptr_t>(row[1]));
          j.ndim = static_cast<int>(row[2]);
          if (j.ndim < 1 || j.ndim > kMaxDims)
            throw std::invalid_argument("miles_transfer._ext.copy: ndim out of range");
          for (int k = 0; k < kMaxDims; ++k) {
            j.shape[k] = row[3 + k];
            j.src_strides[k] = row[3 + kMaxDims + k];
            j.dst_strides[k] = row[3 + 2 * kMaxDims + k];
            if (k < j.ndim && j.shape[k] < 0)
              throw std::invalid_argument("miles_transfer._ext.copy: negative extent");
          }
        }
        nb::gil_scoped_release release;
        copy_jobs(jobs.data(), n, threads);
      },
      nb::arg("jobs"), nb::arg("threads"),
      "Run strided byte copies; see bindings/nanobind_module.cpp for the descriptor layout.");

  m.def(
      "delta_scan",
      [](uintptr_t base, uintptr_t next, int64_t n, int width, bool xor_values,
         uintptr_t positions, uintptr_t values, int64_t cap, uintptr_t hash_next,
         uintptr_t hash_base, int64_t hash_offset) {
        check_width_len(width, n, "delta_scan");
        if ((hash_next != 0 || hash_base != 0) && hash_offset % 64 != 0)
          throw std::invalid_argument("miles_transfer._ext.delta_scan: hash_offset % 64 != 0");
        nb::gil_scoped_release release;
        return delta_scan(ptr<const uint8_t>(base), ptr<const uint8_t>(next), n, width,
                          xor_values, ptr<int32_t>(positions), ptr<uint8_t>(values), cap,
                          ptr<Xxh3Long>(hash_next), ptr<Xxh3Long>(hash_base), hash_offset);
      },
      nb::arg("base"), nb::arg("next"), nb::arg("n"), nb::arg("width"), nb::arg("xor_values"),
      nb::arg("positions"), nb::arg("values"), nb::arg("cap"), nb::arg("hash_next") = 0,
      nb::arg("hash_base") = 0, nb::arg("hash_offset") = 0,
      "Changed elements of next vs base: positions and values written if at most cap; returns "
      "the count. positions needs cap + 16 entries, values cap * width + 64 bytes. hash_next / "
      "hash_base: addresses of Xxh3Long states fed next's / base's bytes at hash_offset (0: "
      "none).");
  m.attr("XXH3_STATE_BYTES") = static_cast<int64_t>(sizeof(Xxh3Long));
  m.def(
      "xxh3_long_init",
      [](uintptr_t state, int64_t len) {
        if (len <= 240)
          throw std::invalid_argument("miles_transfer._ext.xxh3_long_init: len <= 240");
        xxh3_long_init(ptr<Xxh3Long>(state), len);
      },
      nb::arg("state"), nb::arg("len"), "Start an XXH3-128 digest of len (> 240) bytes.");
  m.def(
      "xxh3_long_update",
      [](uintptr_t state, uintptr_t data, int64_t offset, int64_t bytes) {
        if (offset % 64 != 0 || bytes < 0)
          throw std::invalid_argument("miles_transfer._ext.xxh3_long_update: bad offset/bytes");
        nb::gil_scoped_release release;
        xxh3_long_update(ptr<Xxh3Long>(state), ptr<const uint8_t>(data), offset, bytes);
      },
      nb::arg("state"), nb::arg("data"), nb::arg("offset"), nb::arg("bytes"),
      "Feed input bytes [offset, offset + bytes) (offset a multiple of 64).");
  m.def(
      "xxh3_long_digest",
      [](uintptr_t state, uintptr_t input_end) {
        uint64_t high = 0, low = 0;
        xxh3_long_digest(ptr<const Xxh3Long>(state), ptr<const uint8_t>(input_end), &high, &low);
        return nb::make_tuple(high, low);
      },
      nb::arg("state"), nb::arg("input_end"), "(high, low) of the finished digest.");
  m.def(
      "pack_sparse",
      [](uintptr_t positions, uintptr_t values, int64_t k, int width, uintptr_t out) {
        check_width_len(width, k, "pack_sparse");
        nb::gil_scoped_release release;
        pack_sparse(ptr<const int32_t>(positions), ptr<const uint8_t>(values), k, width,
                    ptr<uint8_t>(out));
      },
      nb::arg("positions"), nb::arg("values"), nb::arg("k"), nb::arg("width"), nb::arg("out"),
      "The sparse layout (gap planes, value planes) of k scanned elements.");
  m.def(
      "dense_encode",
      [](uintptr_t base, uintptr_t next, int64_t n, int width, bool xor_values, uintptr_t out) {
        check_width_len(width, n, "dense_encode");
        nb::gil_scoped_release release;
        dense_encode(ptr<const uint8_t>(base), ptr<const uint8_t>(next), n, width, xor_values,
                     ptr<uint8_t>(out));
      },
      nb::arg("base"), nb::arg("next"), nb::arg("n"), nb::arg("width"), nb::arg("xor_values"),
      nb::arg("out"), "Byte planes of next ^ base (xor) or next.");
  m.def(
      "sparse_apply",
      [](uintptr_t target, int64_t n, int width, nb::bytes raw, int64_t k, bool xor_values) {
        check_width_len(width, n, "sparse_apply");
        if (k < 0 || static_cast<int64_t>(raw.size()) != k * (4 + width))
          throw std::invalid_argument("miles_transfer._ext.sparse_apply: raw size != k*(4+width)");
        int64_t last = -1;
        int status;
        {
          nb::gil_scoped_release release;
          status = sparse_apply(ptr<uint8_t>(target), n, width,
                                reinterpret_cast<const uint8_t*>(raw.c_str()), k, xor_values,
                                &last);
        }
        return nb::make_tuple(status, last);
      },
      nb::arg("target"), nb::arg("n"), nb::arg("width"), nb::arg("raw"), nb::arg("k"),
      nb::arg("xor_values"),
      "Patch from a sparse chunk; returns (status, last position); status 0 ok, 1 gaps not "
      "increasing, 2 out of range (nothing written unless 0).");
  m.def(
      "dense_apply",
      [](uintptr_t target, int64_t n, int width, nb::bytes raw, bool xor_values) {
        check_width_len(width, n, "dense_apply");
        if (static_cast<int64_t>(raw.size()) != n * width)
          throw std::invalid_argument("miles_transfer._ext.dense_apply: raw size != n*width");
        nb::gil_scoped_release release;
        dense_apply(ptr<uint8_t>(target), n, width, reinterpret_cast<const uint8_t*>(raw.c_str()),
                    xor_values);
      },
      nb::arg("target"), nb::arg("n"), nb::arg("width"), nb::arg("raw"), nb::arg("xor_values"),
      "Patch from a dense chunk.");
  m.def(
      "apply_fused",
      [](uintptr_t target, uintptr_t source, int64_t n, int width, int layout, nb::bytes raw,
         int64_t k, bool xor_values, uintptr_t hash, int64_t hash_offset) {
        check_width_len(width, n, "apply_fused");
        const int64_t size = static_cast<int64_t>(raw.size());
        const bool ok = (layout == kLayoutNone && size == 0) ||
                        (layout == kLayoutSparse && k >= 0 && size == k * (4 + width)) ||
                        (layout == kLayoutDense && size == n * width);
        if (!ok) throw std::invalid_argument("miles_transfer._ext.apply_fused: bad layout/size");
        if (hash != 0 && hash_offset % 64 != 0)
          throw std::invalid_argument("miles_transfer._ext.apply_fused: hash_offset % 64 != 0");
        int64_t last = -1;
        int status;
        {
          nb::gil_scoped_release release;
          status = apply_fused(ptr<uint8_t>(target), ptr<const uint8_t>(source), n, width, layout,
                               reinterpret_cast<const uint8_t*>(raw.c_str()), k, xor_values,
                               ptr<Xxh3Long>(hash), hash_offset, &last);
        }
        return nb::make_tuple(status, last);
      },
      nb::arg("target"), nb::arg("source"), nb::arg("n"), nb::arg("width"), nb::arg("layout"),
      nb::arg("raw"), nb::arg("k"), nb::arg("xor_values"), nb::arg("hash"),
      nb::arg("hash_offset"),
      "Copy + patch + hash one chunk of a result; returns (status, last position) as "
      "sparse_apply. layout 0 none, 1 sparse, 2 dense.");
  m.def("delta_isa", []() { return std::string(delta_isa()); },
        "The delta kernels' instruction set: avx512, avx2 or generic.");
  m.def("delta_use_isa", [](const std::string& name) { return delta_use_isa(name.c_str()); },
        nb::arg("name"), "Use avx512, avx2 or generic from now on if supported (tests).");
}
