# Benchmark suite of paged MHA/GQA decode (decode-mha; 'decode --mha' hands over to it).
