# Tests of the config module and deploy files (kvferry_add_gtest(...)).
