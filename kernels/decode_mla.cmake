# Sources of the decode_mla kernels (CPU always, CUDA when KVFERRY_WITH_CUDA).
