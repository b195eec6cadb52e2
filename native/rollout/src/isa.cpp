// The run-time choice of instruction set shared by every kernel (see include/miles_rollout/isa.h).
#include "miles_rollout/isa.h"

#include <string_view>

#include "common.h"

namespace miles_rollout {
namespace detail {
namespace {

Isa detect() {
#ifdef MILES_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma")) return Isa::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::kAvx2;
#endif
  return Isa::kGeneric;
}

Isa g_isa = detect();

}  // namespace

Isa active_isa() { return g_isa; }

}  // namespace detail

const char* kernel_isa() {
  switch (detail::g_isa) {
    case detail::Isa::kAvx512: return "avx512";
    case detail::Isa::kAvx2: return "avx2";
    default: return "generic";
  }
}

bool use_isa(const char* name) {
  using detail::Isa;
  const std::string_view want(name);
  const Isa best = detail::detect();
  if (want == "generic") {
    detail::g_isa = Isa::kGeneric;
  } else if (want == "avx2" && best != Isa::kGeneric) {
    detail::g_isa = Isa::kAvx2;
  } else if (want == "avx512" && best == Isa::kAvx512) {
    detail::g_isa = Isa::kAvx512;
  } else {
    return false;
  }
  return true;
}

}  // namespace miles_rollout
