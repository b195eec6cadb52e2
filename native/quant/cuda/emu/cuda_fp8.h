// The CPU emulator's stand-in for CUDA's cuda_fp8.h: quantize.cu converts to FP8 in hardware only
// where __CUDA_ARCH__ >= 890, which the emulator never defines (see mq_cuda_emu.h).
#pragma once
#include "mq_cuda_emu.h"
