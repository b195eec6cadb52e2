// The one binding file: miles_transfer._ext, a thin nanobind layer over copy_jobs.
//
// `copy(jobs, threads)` takes an int64 array of shape [n, 3 + 3 * kMaxDims]: per job the source
// address, the destination address, ndim, then shape, source strides and destination strides
// (bytes, kMaxDims slots each). The Python wrapper (miles_transfer._reshard) builds the array
// from tensors it keeps alive and checks every box against its tensor's bounds; this layer
// checks the array's form. The copy runs without the GIL.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "miles_transfer/strided_copy.h"

namespace nb = nanobind;
using namespace miles_transfer;

using I64 = nb::ndarray<int64_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

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
}
