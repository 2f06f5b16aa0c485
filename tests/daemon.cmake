# Tests of the daemon area (kvferry_add_gtest(...)).
kvferry_add_gtest(protocol_test LABEL unit
  SOURCES unit/protocol_test.cpp unit/ring_test.cpp
  LIBS kvferry::connector)
