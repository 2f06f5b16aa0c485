# Tests of the decode_paged area (kvferry_add_gtest(...)).
