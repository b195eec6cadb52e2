// The one binding file: miles_rollout._ext, a thin nanobind layer over the decode-attention
// kernel (decode_attention.h, bf16 and fp32) and the RMSNorm kernel (rms_norm.h). Tensors arrive as addresses, sizes and strides (elements): the
// Python wrapper (miles_rollout._native_attention) owns the tensors and checks dtypes, shapes,
// strides and bounds; this layer checks the scalars. The kernel runs without the GIL.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "miles_rollout/decode_attention.h"
#include "miles_rollout/isa.h"
#include "miles_rollout/rms_norm.h"

namespace nb = nanobind;
using namespace miles_rollout;

NB_MODULE(_ext, m) {
  m.doc() = "miles_rollout native decode attention (see miles_rollout/_native_attention.py)";
  m.def(
      "decode_attention",
      [](uintptr_t q, int64_t q_stride_n, int64_t q_stride_kv, int64_t q_stride_g, uintptr_t k,
         uintptr_t v, int64_t t_cap, uintptr_t lengths, int64_t n, int64_t kv_heads,
         int64_t group, int64_t head_dim, float scale, uintptr_t out, uintptr_t rows,
         int64_t batch_cap, const std::string& dtype) {
        if (n < 0 || kv_heads < 1 || group < 1 || t_cap < 1)
          throw std::invalid_argument(
              "miles_rollout._ext.decode_attention: n >= 0, kv_heads, group, t_cap >= 1");
        if (head_dim < 16 || head_dim % 16 != 0)
          throw std::invalid_argument(
              "miles_rollout._ext.decode_attention: head_dim must be a positive multiple of 16");
        if (dtype != "bfloat16" && dtype != "float32")
          throw std::invalid_argument(
              "miles_rollout._ext.decode_attention: dtype must be 'bfloat16' or 'float32'");
        if (rows != 0 && batch_cap < 1)
          throw std::invalid_argument(
              "miles_rollout._ext.decode_attention: rows need the cache's batch_cap >= 1");
        const DecodeAttention a{reinterpret_cast<const void*>(q),
                                q_stride_n,
                                q_stride_kv,
                                q_stride_g,
                                reinterpret_cast<const void*>(k),
                                reinterpret_cast<const void*>(v),
                                batch_cap,
                                t_cap,
                                reinterpret_cast<const int64_t*>(rows),
                                reinterpret_cast<const int64_t*>(lengths),
                                n,
                                kv_heads,
                                group,
                                head_dim,
                                scale,
                                dtype == "float32",
                                reinterpret_cast<void*>(out)};
        int64_t bad;
        {
          nb::gil_scoped_release release;
          bad = decode_attention(a);
        }
        if (bad > 0)
          throw std::invalid_argument(
              "miles_rollout._ext.decode_attention: lengths[" + std::to_string(bad - 1) + "] = " +
              std::to_string(a.lengths[bad - 1]) + " is outside [1, " +
              std::to_string(t_cap) + "] (the cache's positions)");
        if (bad < 0)
          throw std::invalid_argument(
              "miles_rollout._ext.decode_attention: rows[" + std::to_string(-bad - 1) + "] = " +
              std::to_string(a.rows[-bad - 1]) + " is outside [0, " + std::to_string(batch_cap) +
              ") (the cache's rows)");
      },
      nb::arg("q"), nb::arg("q_stride_n"), nb::arg("q_stride_kv"), nb::arg("q_stride_g"),
      nb::arg("k"), nb::arg("v"), nb::arg("t_cap"), nb::arg("lengths"), nb::arg("n"),
      nb::arg("kv_heads"), nb::arg("group"), nb::arg("head_dim"), nb::arg("scale"),
      nb::arg("out"), nb::arg("rows") = 0, nb::arg("batch_cap") = 0,
      nb::arg("dtype") = "bfloat16",
      "bf16 or fp32 attention of query tokens over rows of a slot KV cache (rows: 0 = query b "
      "reads row b); see native/rollout/include/miles_rollout/decode_attention.h for the "
      "layout and numerics.");
  m.def(
      "rms_norm",
      [](uintptr_t x, int64_t a, int64_t b, int64_t d, int64_t x_stride_a, int64_t x_stride_b,
         uintptr_t w, int64_t w_stride_b, float eps, uintptr_t out) {
        if (a < 0 || b < 0)
          throw std::invalid_argument("miles_rollout._ext.rms_norm: negative extent");
        if (d < 16 || d % 16 != 0)
          throw std::invalid_argument(
              "miles_rollout._ext.rms_norm: d must be a positive multiple of 16");
        const RmsNorm args{reinterpret_cast<const uint16_t*>(x),
                           a,
                           b,
                           d,
                           x_stride_a,
                           x_stride_b,
                           reinterpret_cast<const uint16_t*>(w),
                           w_stride_b,
                           eps,
                           reinterpret_cast<uint16_t*>(out)};
        nb::gil_scoped_release release;
        rms_norm(args);
      },
      nb::arg("x"), nb::arg("a"), nb::arg("b"), nb::arg("d"), nb::arg("x_stride_a"),
      nb::arg("x_stride_b"), nb::arg("w"), nb::arg("w_stride_b"), nb::arg("eps"), nb::arg("out"),
      "bf16 RMSNorm of x [a, b, d] (strides x_stride_a, x_stride_b, 1) with weight rows w [b, d] "
      "(w_stride_b 0: one weight) into out [a, b, d] contiguous; see rms_norm.h.");
  m.def("kernel_isa", &kernel_isa, "The implementation in use: 'avx512', 'avx2' or 'generic'.");
  m.def(
      "use_isa", [](const std::string& name) { return use_isa(name.c_str()); },
      nb::arg("name"),
      "Use 'avx512', 'avx2' or 'generic' from now on if this CPU supports it (for tests); "
      "returns False and changes nothing otherwise.");
}
