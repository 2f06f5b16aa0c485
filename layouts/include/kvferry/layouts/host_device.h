#pragma once
// KVFERRY_HOST_DEVICE marks functions that compile for both the host and CUDA device code.
#if defined(__CUDACC__)
#define KVFERRY_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define KVFERRY_HOST_DEVICE inline
#endif
