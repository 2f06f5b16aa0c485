# Tests of the decode_mla area (kvferry_add_gtest(...)).
