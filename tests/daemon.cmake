# Tests of the daemon area (kvferry_add_gtest(...)).
