# Benchmark suites of the daemon area (target_sources(kvferry_bench PRIVATE ...)).
