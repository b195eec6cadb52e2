// Which instruction set the miles-rollout kernels use (chosen at load time from the CPU).
#pragma once

namespace miles_rollout {

// "avx512", "avx2" or "generic".
const char* kernel_isa();

// Uses `name` ("avx512", "avx2" or "generic") for every kernel from now on if this CPU supports
// it (returns false and changes nothing otherwise). For tests: every implementation gives the
// same bits. Not thread-safe: call it while no kernel runs.
bool use_isa(const char* name);

}  // namespace miles_rollout
