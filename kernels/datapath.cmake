# Sources of the datapath kernels (CPU always, CUDA when KVFERRY_WITH_CUDA).
