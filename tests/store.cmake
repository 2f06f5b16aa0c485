# Tests of the block index, host tier and metrics.
kvferry_add_gtest(store_test LABEL unit
  SOURCES unit/store_pool_test.cpp unit/store_index_test.cpp unit/store_metrics_test.cpp unit/store_http_test.cpp unit/store_offload_test.cpp
  LIBS kvferry::store Boost::headers)
