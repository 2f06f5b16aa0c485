# Tests of the block index and host tier.
kvferry_add_gtest(store_test LABEL unit
  SOURCES unit/store_pool_test.cpp unit/store_index_test.cpp unit/store_metrics_test.cpp
  LIBS kvferry::store)
