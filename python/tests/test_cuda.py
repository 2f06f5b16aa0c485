"""The package on the CUDA backend: zero-copy torch views of a GPU region, and a save/load round
trip of torch data through the daemon's host pool. Skips (with the reason) without torch or a GPU;
run on the GPU machine (scripts/gpu-check.sh runs it)."""

from __future__ import annotations

import pytest

import kvferry

torch = pytest.importorskip("torch", reason="torch is not installed: the CUDA views need it")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the CUDA-backend views are tested on the GPU machine", allow_module_level=True)

LAYERS, BLOCKS, BS = 3, 16, 64


@pytest.fixture
def gpu_client(start_daemon):
    d = start_daemon(backend="cuda", capacity="256MiB")
    with kvferry.Client(socket=d.socket, name="pytest-cuda", model="m") as c:
        yield c


def test_layer_views_alias_the_gpu_region_without_a_copy(gpu_client):
    r = gpu_client.create_region("g", LAYERS, BLOCKS, BS, "mla_bf16")
    assert r.on_device
    views = [r.layer_view(l) for l in range(LAYERS)]
    for l, v in enumerate(views):
        assert v.is_cuda and v.dtype == torch.bfloat16 and tuple(v.shape) == (BLOCKS, BS, 576)
        # Block-major: layer l starts l pages in, and a block's stride spans every layer.
        assert v.data_ptr() == views[0].data_ptr() + l * BS * 576 * 2
        assert v.stride(0) == LAYERS * BS * 576
    views[1][5].fill_(3.0)
    again = r.layer_view(1)
    assert bool((again[5] == 3.0).all()), "a second view sees what the first wrote: one memory"
    assert bool((views[0][5] == 0).all()) and bool((views[2][5] == 0).all()), "other layers untouched"
    iface = r.layer_view(0, as_="interface")
    assert iface.__cuda_array_interface__["data"][0] == views[0].data_ptr()


def test_save_and_load_of_torch_data_round_trip_on_the_gpu(gpu_client):
    r = gpu_client.create_region("rt", LAYERS, BLOCKS, BS, "mla_bf16")
    g = torch.Generator(device="cuda").manual_seed(7)
    want = []
    for l in range(LAYERS):
        v = r.layer_view(l)
        v[:4].copy_(torch.randn(4, BS, 576, device="cuda", generator=g, dtype=torch.float32).to(torch.bfloat16))
        want.append(v[:4].clone())
    torch.cuda.synchronize()
    keys = [kvferry.key_bytes(99, i) for i in range(4)]
    assert gpu_client.save(r, keys, torch.arange(4)).done == 4  # block ids as a tensor
    for l in range(LAYERS):
        r.layer_view(l).zero_()
    torch.cuda.synchronize()
    assert gpu_client.load(r, keys, [8, 9, 10, 11]).done == 4
    for l in range(LAYERS):
        v = r.layer_view(l)
        assert torch.equal(v[8:12], want[l]), f"layer {l} came back different"
        assert not bool(v[:8].any()), f"layer {l}: blocks other than the targets were written"
