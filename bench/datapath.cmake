# Benchmark suites of the datapath area (target_sources(kvferry_bench PRIVATE ...)).
