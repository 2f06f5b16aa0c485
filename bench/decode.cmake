# Benchmark suites of the decode area (target_sources(kvferry_bench PRIVATE ...)).
