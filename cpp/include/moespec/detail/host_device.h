// MOESPEC_HD: a function compiled for the host and, under nvcc, for the device too (the arithmetic
// and block code the CPU and the CUDA kernels share: route_math.h, draft_tree_block.h).
#pragma once

#ifdef __CUDACC__
#define MOESPEC_HD __host__ __device__ __forceinline__
#else
#define MOESPEC_HD inline
#endif
