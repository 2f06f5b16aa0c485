# Tests of the datapath area (kvferry_add_gtest(...)).
