#!/usr/bin/env python3
"""What fp8 tensor-core math would cost MLA decode in accuracy (kernels/DESIGN.md §3.5 (docs/notes/kernels-rounds.md has the round)).

Float64 simulation of one request (16 heads, 4096 tokens, 576-dim e4m3 cache, bf16-range Q drawn
as kvferry-bench decode draws them): the relative error norm of the output when Q (scaled per
row to e4m3's range), P (times 448) or both are rounded to e4m3 before their products, and when Q
is split into two e4m3 terms. The decode tests bound the error at 1e-2.
Usage: python3 bench/fp8_mma_error.py  (needs numpy)
"""
import numpy as np

rng = np.random.default_rng(1)


def e4m3(x):
    """Round to the nearest e4m3 value (ties to even), saturating at 448."""
    a = np.abs(x)
    e = np.maximum(np.floor(np.log2(np.maximum(a, 2.0**-9))), -6)
    q = 2.0 ** (e - 3)
    return np.sign(x) * np.minimum(np.round(a / q) * q, 448.0)


def rand_values(shape):
    """+-[2^-7, 2) with a random exponent, as the bench's bf16 inputs."""
    e = rng.integers(-7, 1, size=shape)
    return rng.choice([-1, 1], size=shape) * (1 + rng.random(shape)) * 2.0**e


def main():
    heads, tokens = 16, 4096
    errors = {"Q e4m3": [], "P e4m3": [], "Q and P e4m3": [], "Q as two e4m3 terms": []}
    for _ in range(4):
        q = rand_values((heads, 576))
        kv = e4m3(rand_values((tokens, 576)))
        v, scale = kv[:, :512], 1 / np.sqrt(192)

        def attend(qq, p_round=None):
            s = qq @ kv.T * scale
            p = np.exp(s - s.max(1, keepdims=True))
            l = p.sum(1, keepdims=True)
            if p_round is not None:
                p = p_round(p)
            return (p @ v) / l

        ref = attend(q)
        up = 448 / np.abs(q).max(1, keepdims=True)
        q8 = e4m3(q * up) / up
        q16 = (e4m3(q * up) + e4m3(q * up - e4m3(q * up))) / up
        p8 = lambda p: e4m3(p * 448) / 448
        for name, o in (("Q e4m3", attend(q8)), ("P e4m3", attend(q, p8)), ("Q and P e4m3", attend(q8, p8)),
                        ("Q as two e4m3 terms", attend(q16))):
            errors[name].append(np.linalg.norm(o - ref) / np.linalg.norm(ref))
    for name, e in errors.items():
        print(f"{name:22s} relative error {min(e):.4f} .. {max(e):.4f}")


if __name__ == "__main__":
    main()
