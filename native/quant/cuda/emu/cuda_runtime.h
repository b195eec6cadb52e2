// The CPU emulator's stand-in for CUDA's cuda_runtime.h (see mq_cuda_emu.h).
#pragma once
#include "mq_cuda_emu.h"
