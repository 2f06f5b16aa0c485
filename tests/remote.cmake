# The remote tier's building blocks (issue 38): placement and member records (unit), membership in
# a real etcd started by the test, the UCX transport between processes on loopback (integration).
kvferry_add_gtest(remote_unit_test LABEL unit
  SOURCES unit/placement_test.cpp
  LIBS kvferry::store)
kvferry_add_gtest(membership_integration_test LABEL integration TIMEOUT 120
  SOURCES integration/membership_test.cpp
  LIBS kvferry::store)
