# Sources of the decode_paged kernels (CPU always, CUDA when KVFERRY_WITH_CUDA).
