# Benchmark suite of paged MHA/GQA decode (decode-mha; 'decode --mha' hands over to it).
target_sources(kvferry_bench PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/decode_mha_suite.cpp)
