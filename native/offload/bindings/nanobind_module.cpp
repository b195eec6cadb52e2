// The one binding file: miles_offload._ext, a thin nanobind layer over the pager (pager.h).
// Buffers arrive as integer addresses (tensor.data_ptr()) and sizes; the Python wrapper
// (miles_offload/_pager.py) checks alignment and bounds. Transfers and checksums run without the
// GIL. I/O errors come back as a positive errno (0 on success) so that Python raises OSError;
// read/write return (errno, CRC-32C of the requested part, computed while the I/O runs).
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cerrno>
#include <cstdint>
#include <system_error>

#include "miles_offload/pager.h"

namespace nb = nanobind;
using namespace miles_offload;

namespace {

void* ptr(uintptr_t address) { return reinterpret_cast<void*>(address); }

template <typename F>
int guarded(F&& f) {
  try {
    f();
    return 0;
  } catch (const std::system_error& e) {
    return e.code().value() != 0 ? e.code().value() : EIO;
  }
}

}  // namespace

NB_MODULE(_ext, m) {
  m.doc() = "miles_offload native pager (see miles_offload/_pager.py for the Python wrapper)";

  m.def("built_with_io_uring", &built_with_io_uring, "Whether this build links liburing.");

  m.def(
      "crc32c",
      [](uintptr_t address, std::size_t len, uint32_t crc) {
        nb::gil_scoped_release release;
        return crc32c(crc, ptr(address), len);
      },
      nb::arg("address"), nb::arg("length"), nb::arg("crc") = 0,
      "CRC-32C of `length` bytes at `address`, continuing from `crc`.");

  m.attr("ENODATA_EOF") = ENODATA;

  nb::class_<Pager>(m, "Pager")
      .def(
          "__init__",
          [](Pager* self, unsigned queue_depth, std::size_t block_size, bool force_threads) {
            PagerOptions o;
            o.queue_depth = queue_depth;
            o.block_size = block_size;
            o.force_threads = force_threads;
            new (self) Pager(o);
          },
          nb::arg("queue_depth"), nb::arg("block_size"), nb::arg("force_threads"))
      .def_prop_ro("backend",
                   [](const Pager& p) {
                     return p.backend() == Backend::io_uring ? "io_uring" : "threads";
                   })
      .def_prop_ro("fallback_reason", [](const Pager& p) { return p.fallback_reason(); })
      .def_prop_ro("queue_depth", &Pager::queue_depth)
      .def_prop_ro("block_size", &Pager::block_size)
      .def(
          "register_buffers",
          [](Pager& p, const std::vector<std::pair<uintptr_t, std::size_t>>& bufs) {
            std::vector<std::pair<void*, std::size_t>> v;
            for (const auto& b : bufs) v.emplace_back(ptr(b.first), b.second);
            nb::gil_scoped_release release;
            return p.register_buffers(v);
          },
          nb::arg("buffers"))
      .def(
          "read",
          [](Pager& p, int fd, uint64_t offset, uintptr_t address, std::size_t len,
             int64_t crc_from) {
            uint32_t crc = 0;
            int rc;
            {
              nb::gil_scoped_release release;
              rc = guarded([&] {
                p.read(fd, offset, ptr(address), len, crc_from >= 0 ? &crc : nullptr,
                       crc_from >= 0 ? static_cast<std::size_t>(crc_from) : 0);
              });
            }
            return std::make_pair(rc, crc);
          },
          nb::arg("fd"), nb::arg("offset"), nb::arg("address"), nb::arg("length"),
          nb::arg("crc_from") = -1,
          "Returns (errno or 0, CRC-32C of bytes [crc_from, length) when crc_from >= 0).")
      .def(
          "write",
          [](Pager& p, int fd, uint64_t offset, uintptr_t address, std::size_t len,
             int64_t crc_from) {
            uint32_t crc = 0;
            int rc;
            {
              nb::gil_scoped_release release;
              rc = guarded([&] {
                p.write(fd, offset, ptr(address), len, crc_from >= 0 ? &crc : nullptr,
                       crc_from >= 0 ? static_cast<std::size_t>(crc_from) : 0);
              });
            }
            return std::make_pair(rc, crc);
          },
          nb::arg("fd"), nb::arg("offset"), nb::arg("address"), nb::arg("length"),
          nb::arg("crc_from") = -1,
          "Returns (errno or 0, CRC-32C of bytes [crc_from, length) when crc_from >= 0).")
      .def("stats", [](const Pager& p) {
        const PagerStats s = p.stats();
        nb::dict d;
        d["bytes_read"] = s.bytes_read;
        d["bytes_written"] = s.bytes_written;
        d["requests"] = s.requests;
        d["fixed_requests"] = s.fixed_requests;
        d["submit_calls"] = s.submit_calls;
        return d;
      });
}
