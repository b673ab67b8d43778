import gzip
import hashlib
import io
import math
import os
import pickle
import re
import struct
import sys
import tarfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

from ddpkit.training import data
from ddpkit.training.data import (
    DATASETS,
    FASHION_MNIST_ROOT,
    ShardedBatches,
    dataset_info,
    download_url,
    load_cifar,
    load_dataset,
    load_fashion_mnist,
    normalize,
    random_crop_flip,
    read_idx,
)

from helpers import CIFAR_LAYOUT, write_cifar

# ----------------------------------------------------------------------------------------------
# IDX / Fashion-MNIST


def idx_bytes(array: np.ndarray, magic: int = None) -> bytes:
    magic = 0x800 + array.ndim if magic is None else magic
    return struct.pack(f">I{array.ndim}I", magic, *array.shape) + array.astype(np.uint8).tobytes()


def write(path: Path, payload: bytes, compress: bool) -> Path:
    path = path.with_name(path.name + ".gz") if compress else path
    path.write_bytes(gzip.compress(payload) if compress else payload)
    return path


def write_fashion_mnist(root: Path, train: int = 7, test: int = 3, compress: bool = True, seed: int = 0):
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    splits = {}
    for prefix, n in (("train", train), ("t10k", test)):
        images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, n, dtype=np.uint8)
        write(root / f"{prefix}-images-idx3-ubyte", idx_bytes(images), compress)
        write(root / f"{prefix}-labels-idx1-ubyte", idx_bytes(labels), compress)
        splits[prefix] = (images, labels)
    return splits


@pytest.mark.parametrize("compress", [False, True])
def test_read_idx_raw_and_gzip(tmp_path, compress):
    images = np.random.default_rng(1).integers(0, 256, (4, 28, 28), dtype=np.uint8)
    labels = np.array([0, 9, 3, 3], dtype=np.uint8)
    image_path = write(tmp_path / "images", idx_bytes(images), compress)
    label_path = write(tmp_path / "labels", idx_bytes(labels), compress)
    read_images, read_labels = read_idx(image_path), read_idx(label_path)
    assert read_images.dtype == torch.uint8 and read_images.shape == (4, 28, 28)
    assert torch.equal(read_images, torch.from_numpy(images))
    assert torch.equal(read_labels, torch.from_numpy(labels))


def test_load_fashion_mnist_from_raw_and_gzip_files(tmp_path):
    splits = write_fashion_mnist(tmp_path, compress=True)
    # A raw file beside the gzipped ones is found too (and preferred).
    raw_labels = np.array([1, 2, 3], dtype=np.uint8)
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(idx_bytes(raw_labels))
    images, labels = load_fashion_mnist(tmp_path, train=True)
    assert images.shape == (7, 1, 28, 28) and images.dtype == torch.uint8
    assert labels.shape == (7,) and labels.dtype == torch.int64
    assert torch.equal(images[:, 0], torch.from_numpy(splits["train"][0]))
    assert torch.equal(labels, torch.from_numpy(splits["train"][1]).long())
    test_images, test_labels = load_fashion_mnist(tmp_path, train=False)
    assert torch.equal(test_images[:, 0], torch.from_numpy(splits["t10k"][0]))
    assert test_labels.tolist() == [1, 2, 3]


def test_fashion_mnist_root_from_environment(tmp_path, monkeypatch):
    write_fashion_mnist(tmp_path, train=2)
    monkeypatch.setenv("DDPKIT_FASHION_MNIST", str(tmp_path))
    images, _ = load_fashion_mnist()
    assert len(images) == 2
    assert len(load_dataset("fashion_mnist")[0]) == 2


def test_idx_bad_magic(tmp_path):
    path = tmp_path / "bad"
    path.write_bytes(idx_bytes(np.zeros((2, 28, 28), np.uint8), magic=0x00000D03))  # 0x0D: float elements
    with pytest.raises(ValueError, match=r"magic number 0x00000d03 .*0x00000801.*0x00000803"):
        read_idx(path)
    path.write_bytes(b"\x12\x34\x08\x01" + b"\0" * 8)
    with pytest.raises(ValueError, match="magic number 0x12340801"):
        read_idx(path)


def test_fashion_mnist_rejects_a_labels_file_in_place_of_images(tmp_path):
    write_fashion_mnist(tmp_path)
    write(tmp_path / "train-images-idx3-ubyte", idx_bytes(np.zeros(7, np.uint8)), compress=True)
    with pytest.raises(ValueError, match=r"expected Fashion-MNIST images \(magic 0x00000803.*found magic 0x00000801"):
        load_fashion_mnist(tmp_path)


def test_fashion_mnist_rejects_wrong_image_size(tmp_path):
    write_fashion_mnist(tmp_path)
    write(tmp_path / "train-images-idx3-ubyte", idx_bytes(np.zeros((7, 32, 32), np.uint8)), compress=True)
    with pytest.raises(ValueError, match=r"shape \[7, 32, 32\]"):
        load_fashion_mnist(tmp_path)


@pytest.mark.parametrize("compress", [False, True])
def test_idx_truncated_data(tmp_path, compress):
    payload = idx_bytes(np.ones((3, 28, 28), np.uint8))[:-10]
    path = write(tmp_path / "images", payload, compress)
    with pytest.raises(
        ValueError,
        match=r"truncated: the header promises shape \[3, 28, 28\] = 2352 bytes of data, "
        r"the file holds 2342",
    ):
        read_idx(path)


def test_idx_truncated_header_and_gzip_stream(tmp_path):
    path = tmp_path / "header"
    path.write_bytes(struct.pack(">II", 0x803, 3))
    with pytest.raises(ValueError, match="truncated IDX header"):
        read_idx(path)
    path.write_bytes(b"\0\0")
    with pytest.raises(ValueError, match="too short for an IDX header"):
        read_idx(path)
    stream = gzip.compress(idx_bytes(np.arange(784 * 5, dtype=np.uint32).reshape(5, 28, 28) % 251))
    path.write_bytes(stream[: len(stream) // 2])
    with pytest.raises(ValueError, match="corrupt gzip stream"):
        read_idx(path)


def test_idx_trailing_bytes(tmp_path):
    path = tmp_path / "labels"
    path.write_bytes(idx_bytes(np.zeros(4, np.uint8)) + b"\0")
    with pytest.raises(ValueError, match="has trailing bytes"):
        read_idx(path)


def test_fashion_mnist_count_mismatch_and_label_range(tmp_path):
    write_fashion_mnist(tmp_path)
    write(tmp_path / "train-labels-idx1-ubyte", idx_bytes(np.zeros(6, np.uint8)), compress=True)
    with pytest.raises(ValueError, match="holds 7 images but .* holds 6 labels"):
        load_fashion_mnist(tmp_path)
    write(tmp_path / "train-labels-idx1-ubyte", idx_bytes(np.full(7, 10, np.uint8)), compress=True)
    with pytest.raises(ValueError, match=r"labels span \[10, 10\], expected classes 0..9"):
        load_fashion_mnist(tmp_path)


def test_fashion_mnist_missing_directory(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError) as info:
        load_fashion_mnist(missing)
    message = str(info.value)
    assert str(missing) in message
    assert "apt-get install dataset-fashion-mnist" in message
    assert "DDPKIT_FASHION_MNIST" in message


def test_fashion_mnist_missing_file(tmp_path):
    write_fashion_mnist(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    load_fashion_mnist(tmp_path, train=True)
    with pytest.raises(FileNotFoundError, match="t10k-labels-idx1-ubyte.gz"):
        load_fashion_mnist(tmp_path, train=False)


def test_real_fashion_mnist():
    if not Path(FASHION_MNIST_ROOT).is_dir():
        pytest.skip(f"{FASHION_MNIST_ROOT} is absent (apt-get install dataset-fashion-mnist)")
    images, labels = load_fashion_mnist(FASHION_MNIST_ROOT, train=True)
    assert images.shape == (60000, 1, 28, 28) and images.dtype == torch.uint8
    assert labels.shape == (60000,) and labels.dtype == torch.int64
    # Fashion-MNIST is balanced: 6000 training and 1000 test images per class.
    assert torch.bincount(labels, minlength=10).tolist() == [6000] * 10
    test_images, test_labels = load_dataset("fashion_mnist", FASHION_MNIST_ROOT, train=False)
    assert test_images.shape == (10000, 1, 28, 28)
    assert torch.bincount(test_labels, minlength=10).tolist() == [1000] * 10
    # The published mean/std match the data.
    pixels = images.float() / 255
    assert pixels.mean().item() == pytest.approx(DATASETS["fashion_mnist"].mean[0], abs=1e-3)
    assert pixels.std().item() == pytest.approx(DATASETS["fashion_mnist"].std[0], abs=1e-3)


# ----------------------------------------------------------------------------------------------
# CIFAR


@pytest.mark.parametrize("as_archive", [False, True], ids=["directory", "archive"])
@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
def test_cifar_reader(tmp_path, name, as_archive):
    expected = write_cifar(tmp_path, name, as_archive)
    for train, split in ((True, "train"), (False, "test")):
        images, labels = load_cifar(name, tmp_path, train=train)
        want_images, want_labels = expected[split]
        assert images.dtype == torch.uint8 and images.shape == (len(want_images), 3, 32, 32)
        assert labels.dtype == torch.int64 and labels.shape == (len(want_images),)
        assert torch.equal(images, torch.from_numpy(want_images))
        assert torch.equal(labels, torch.from_numpy(want_labels))


def test_cifar_pixel_layout(tmp_path):
    top = tmp_path / "cifar-10-batches-py"
    top.mkdir()
    row = np.arange(3072, dtype=np.int64) % 251
    for member in [f"data_batch_{i}" for i in range(1, 6)]:
        batch = {b"data": row[None].astype(np.uint8), b"labels": [7]}
        (top / member).write_bytes(pickle.dumps(batch, protocol=2))
    images, labels = load_cifar("cifar10", tmp_path)
    assert images.shape == (5, 3, 32, 32)
    for c, y, x in [(0, 0, 0), (0, 0, 31), (0, 1, 0), (1, 0, 0), (1, 5, 9), (2, 31, 31)]:
        assert images[0, c, y, x].item() == (1024 * c + 32 * y + x) % 251
    assert labels.tolist() == [7] * 5


def test_cifar_root_from_environment_and_registry(tmp_path, monkeypatch):
    expected = write_cifar(tmp_path, "cifar100", as_archive=True)
    monkeypatch.setenv("DDPKIT_DATA", str(tmp_path))
    images, labels = load_dataset("cifar100", train=False)
    assert torch.equal(labels, torch.from_numpy(expected["test"][1]))


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
def test_cifar_missing_offline(tmp_path, name):
    top, archive = CIFAR_LAYOUT[name][:2]
    with pytest.raises(FileNotFoundError) as info:
        load_dataset(name, tmp_path)
    message = str(info.value)
    assert str(tmp_path / top) in message and str(tmp_path / archive) in message
    assert f"https://www.cs.toronto.edu/~kriz/{archive}" in message
    assert "--download" in message and "DDPKIT_DATA" in message


def test_cifar_incomplete_directory_and_archive(tmp_path):
    write_cifar(tmp_path / "dir", "cifar10", as_archive=False, skip=("data_batch_3",))
    with pytest.raises(FileNotFoundError, match="data_batch_3 is missing"):
        load_cifar("cifar10", tmp_path / "dir")
    load_cifar("cifar10", tmp_path / "dir", train=False)
    write_cifar(tmp_path / "tar", "cifar10", as_archive=True, skip=("data_batch_3",))
    with pytest.raises(ValueError, match="lacks cifar-10-batches-py/data_batch_3"):
        load_cifar("cifar10", tmp_path / "tar")


def test_cifar_corrupt_archive(tmp_path):
    (tmp_path / "cifar-100-python.tar.gz").write_bytes(os.urandom(1000))
    with pytest.raises(ValueError, match="not a readable .tar.gz"):
        load_cifar("cifar100", tmp_path)


def test_cifar_bad_batch_contents(tmp_path):
    top = tmp_path / "cifar-100-python"
    top.mkdir()
    (top / "test").write_bytes(pickle.dumps({b"data": np.zeros((2, 1024), np.uint8), b"fine_labels": [0, 1]}, 2))
    with pytest.raises(ValueError, match=r"uint8 array of shape \[N, 3072\], found uint8 array of shape \[2, 1024\]"):
        load_cifar("cifar100", tmp_path, train=False)
    (top / "test").write_bytes(pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 1]}, 2))
    with pytest.raises(ValueError, match="no b'fine_labels' entry"):
        load_cifar("cifar100", tmp_path, train=False)
    (top / "test").write_bytes(pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"fine_labels": [0, 100]}, 2))
    with pytest.raises(ValueError, match=r"labels span \[0, 100\], expected classes 0..99"):
        load_cifar("cifar100", tmp_path, train=False)


class _OpensAFile:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_cifar_unpickling_runs_no_foreign_code(tmp_path):
    top = tmp_path / "cifar-100-python"
    top.mkdir()
    marker = tmp_path / "written-by-the-pickle"
    (top / "test").write_bytes(pickle.dumps({b"data": _OpensAFile(str(marker))}, 2))
    with pytest.raises(ValueError, match=r"global io.open is not allowed in a CIFAR batch"):
        load_cifar("cifar100", tmp_path, train=False)
    assert not marker.exists()


@pytest.mark.parametrize(
    "payload,raised",
    [
        # _codecs.encode("x", "no-such-codec"): an allowed global called with a codec that does not exist
        (b"\x80\x02c_codecs\nencode\nX\x01\x00\x00\x00xX\r\x00\x00\x00no-such-codec\x86R.", "LookupError"),
        # BUILD with a dict state on the bytes that _codecs.encode returns: bytes have no __dict__
        (
            b"\x80\x02c_codecs\nencode\nX\x01\x00\x00\x00xX\x06\x00\x00\x00latin1\x86R}X\x01\x00\x00\x00aK\x01sb.",
            "AttributeError",
        ),
        (b"\x80\x02h\x05.", "UnpicklingError"),  # a memo entry that was never stored
    ],
    ids=["lookup", "attribute", "memo"],
)
def test_cifar_corrupt_batch_pickle_is_a_value_error_naming_the_file(tmp_path, payload, raised):
    top = tmp_path / "cifar-100-python"
    top.mkdir()
    (top / "test").write_bytes(payload)
    with pytest.raises(ValueError, match=re.escape(f"{top / 'test'}: not a CIFAR batch pickle ({raised}: ")):
        load_cifar("cifar100", tmp_path, train=False)
    with tarfile.open(tmp_path / "cifar-100-python.tar.gz", "w:gz") as tar:  # the same inside the archive
        info = tarfile.TarInfo("cifar-100-python/test")
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    (top / "test").unlink()
    top.rmdir()
    with pytest.raises(ValueError, match=re.escape(f"cifar-100-python/test: not a CIFAR batch pickle ({raised}: ")):
        load_cifar("cifar100", tmp_path, train=False)


def test_download_url_verifies_md5_and_writes_atomically(tmp_path):
    source = tmp_path / "source.bin"
    payload = os.urandom(3 << 20)
    source.write_bytes(payload)
    digest = hashlib.md5(payload).hexdigest()
    target = tmp_path / "out" / "archive.tar.gz"

    assert download_url(source.as_uri(), target, digest) == target
    assert target.read_bytes() == payload

    target.write_bytes(b"previous contents")
    wrong = "0" * 32
    with pytest.raises(ValueError, match=f"md5 {digest} does not match the expected {wrong}"):
        download_url(source.as_uri(), target, wrong)
    assert target.read_bytes() == b"previous contents"
    assert sorted(p.name for p in target.parent.iterdir()) == ["archive.tar.gz"]  # no partial file left

    with pytest.raises(OSError):
        download_url((tmp_path / "absent").as_uri(), tmp_path / "out" / "other", digest)
    assert sorted(p.name for p in target.parent.iterdir()) == ["archive.tar.gz"]


def _without_torchvision(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchvision", None)  # `import torchvision` raises ImportError


def test_cifar_download_without_torchvision(tmp_path, monkeypatch):
    mirror = tmp_path / "mirror"
    expected = write_cifar(mirror, "cifar10", as_archive=True)
    archive = mirror / "cifar-10-python.tar.gz"
    _without_torchvision(monkeypatch)
    source = data._CIFAR_SOURCES["cifar10"]
    monkeypatch.setitem(
        data._CIFAR_SOURCES,
        "cifar10",
        replace(source, url=archive.as_uri(), md5=hashlib.md5(archive.read_bytes()).hexdigest()),
    )
    root = tmp_path / "root"
    images, labels = load_dataset("cifar10", root, train=True, download=True)
    assert torch.equal(images, torch.from_numpy(expected["train"][0]))
    assert (root / "cifar-10-python.tar.gz").read_bytes() == archive.read_bytes()


def test_cifar_download_failure_names_path_and_url(tmp_path, monkeypatch):
    mirror = tmp_path / "mirror"
    write_cifar(mirror, "cifar100", as_archive=True)
    _without_torchvision(monkeypatch)
    source = data._CIFAR_SOURCES["cifar100"]
    url = (mirror / "cifar-100-python.tar.gz").as_uri()
    monkeypatch.setitem(data._CIFAR_SOURCES, "cifar100", replace(source, url=url))  # the real md5: a mismatch
    root = tmp_path / "root"
    with pytest.raises(FileNotFoundError) as info:
        load_cifar("cifar100", root, download=True)
    message = str(info.value)
    assert str(root / "cifar-100-python.tar.gz") in message and url in message
    assert "the download failed" in message and "does not match" in message
    # What to do without network: fetch the archive elsewhere, check it, put it here; not "use --download".
    assert (
        f"download {url} on another machine, check its md5 is {source.md5}, and copy it to "
        f"{root / 'cifar-100-python.tar.gz'}" in message
    )
    assert "Download it with --download" not in message
    assert not (root / "cifar-100-python.tar.gz").exists()


def test_registry():
    assert sorted(DATASETS) == ["cifar10", "cifar100", "fashion_mnist"]
    cifar10 = dataset_info("cifar10")
    assert (cifar10.channels, cifar10.num_classes, cifar10.image_size) == (3, 10, 32)
    assert cifar10.mean == (0.4914, 0.4822, 0.4465) and cifar10.std == (0.2470, 0.2435, 0.2616)
    cifar100 = dataset_info("cifar100")
    assert (cifar100.num_classes, cifar100.mean, cifar100.std) == (
        100,
        (0.5071, 0.4865, 0.4409),
        (0.2673, 0.2564, 0.2762),
    )
    fashion = dataset_info("fashion_mnist")
    assert (fashion.channels, fashion.num_classes, fashion.image_size, fashion.mean, fashion.std) == (
        1,
        10,
        28,
        (0.2860,),
        (0.3530,),
    )
    with pytest.raises(ValueError, match="unknown dataset 'mnist'"):
        load_dataset("mnist")
    with pytest.raises(ValueError, match="unknown CIFAR dataset"):
        load_cifar("cifar1000")


# ----------------------------------------------------------------------------------------------
# Transforms


def test_normalize_values():
    info = dataset_info("cifar10")
    images = torch.zeros(2, 3, 4, 5, dtype=torch.uint8)
    images[1] = 255
    images[0, 1, 2, 3] = 51
    out = normalize(images, info.mean, info.std)
    assert out.dtype == torch.float32 and out.shape == images.shape
    for c in range(3):
        assert torch.allclose(out[0, c, 0, 0], torch.tensor(-info.mean[c] / info.std[c]))
        assert torch.allclose(out[1, c], torch.full((4, 5), (1 - info.mean[c]) / info.std[c]))
    assert out[0, 1, 2, 3].item() == pytest.approx((0.2 - info.mean[1]) / info.std[1], rel=1e-6)


def test_normalize_rejects_bad_input():
    with pytest.raises(ValueError, match="uint8 batch"):
        normalize(torch.zeros(2, 1, 4, 4), (0.5,), (0.5,))
    with pytest.raises(ValueError, match="1 means and 1 stds for 3 channels"):
        normalize(torch.zeros(2, 3, 4, 4, dtype=torch.uint8), (0.5,), (0.5,))


def test_random_crop_flip_shapes_and_determinism():
    images = torch.randint(0, 256, (16, 3, 32, 32), dtype=torch.uint8)
    first = random_crop_flip(images, 4, torch.Generator().manual_seed(3))
    again = random_crop_flip(images, 4, torch.Generator().manual_seed(3))
    other = random_crop_flip(images, 4, torch.Generator().manual_seed(4))
    assert first.shape == images.shape and first.dtype == torch.uint8
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    assert random_crop_flip(images.float(), 2).dtype == torch.float32


def test_random_crop_flip_without_padding_only_flips():
    images = torch.randint(1, 256, (32, 2, 5, 7), dtype=torch.uint8)
    out = random_crop_flip(images, padding=0, generator=torch.Generator().manual_seed(0))
    flipped = [torch.equal(o, torch.flip(i, [-1])) for o, i in zip(out, images)]
    kept = [torch.equal(o, i) for o, i in zip(out, images)]
    assert all(f or k for f, k in zip(flipped, kept))
    assert any(flipped) and any(kept)


def test_random_crop_flip_draws_every_crop_and_flip():
    padding, n = 2, 400
    images = torch.randint(1, 256, (n, 2, 4, 5), dtype=torch.uint8)  # nonzero pixels: every crop distinct
    out = random_crop_flip(images, padding, torch.Generator().manual_seed(0))
    padded = torch.zeros(n, 2, 4 + 2 * padding, 5 + 2 * padding, dtype=torch.uint8)
    padded[:, :, padding:-padding, padding:-padding] = images

    def crop(i, top, left, flip):
        window = padded[i, :, top : top + 4, left : left + 5]
        return window.flip(-1) if flip else window

    seen = set()
    for i in range(n):
        matches = [
            (top, left, flip)
            for top in range(2 * padding + 1)
            for left in range(2 * padding + 1)
            for flip in (False, True)
            if torch.equal(out[i], crop(i, top, left, flip))
        ]
        assert len(matches) == 1, f"image {i} is not exactly one crop of the padded image"
        seen.add(matches[0])
    assert len(seen) == (2 * padding + 1) ** 2 * 2


def test_random_crop_flip_hand_made():
    image = torch.tensor([[[1, 2], [3, 4]]], dtype=torch.uint8)[None]  # [1, 1, 2, 2]
    # With padding 1 the 4x4 padded image has nine 2x2 crops; the centred unflipped one is the image.
    outcomes = {
        tuple(random_crop_flip(image, 1, torch.Generator().manual_seed(s)).flatten().tolist()) for s in range(200)
    }
    assert (1, 2, 3, 4) in outcomes and (2, 1, 4, 3) in outcomes  # centred, plain and mirrored
    assert (0, 0, 0, 1) in outcomes  # top-left crop: only pixel 1, in its bottom-right corner
    assert (0, 4, 0, 0) in outcomes  # bottom-right crop [[4, 0], [0, 0]], mirrored
    assert len(outcomes) == 18  # nine crops, each plain and mirrored, all distinct


# ----------------------------------------------------------------------------------------------
# Sharding


def reference_batches(n, batch_size, rank, world_size, seed, shuffle, drop_last, epoch):
    sampler = DistributedSampler(range(n), world_size, rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
    sampler.set_epoch(epoch)
    indices = torch.tensor(list(sampler), dtype=torch.int64)
    batches = list(indices.split(batch_size))
    if drop_last and batches and len(batches[-1]) < batch_size:
        batches.pop()
    return batches


SHARDING_CASES = [(10, 1, 3), (10, 2, 3), (10, 3, 2), (11, 4, 2), (7, 8, 1), (100, 3, 7), (64, 4, 16)]


@pytest.mark.parametrize("n,world_size,batch_size", SHARDING_CASES)
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [True, False])
def test_sharding_matches_distributed_sampler(n, world_size, batch_size, drop_last, shuffle):
    if drop_last and n // world_size < batch_size:
        with pytest.raises(ValueError, match="do not fill one batch"):
            ShardedBatches(n, batch_size, 0, world_size, drop_last=drop_last)
        return
    for rank in range(world_size):
        batches = ShardedBatches(n, batch_size, rank, world_size, seed=5, shuffle=shuffle, drop_last=drop_last)
        for epoch in range(3):
            batches.set_epoch(epoch)
            got = list(batches)
            want = reference_batches(n, batch_size, rank, world_size, 5, shuffle, drop_last, epoch)
            assert len(got) == len(want) == len(batches)
            assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("n,world_size,batch_size", SHARDING_CASES)
def test_shards_are_disjoint_and_cover(n, world_size, batch_size):
    shards = [ShardedBatches(n, batch_size, rank, world_size, seed=1) for rank in range(world_size)]
    assert len({len(s) for s in shards}) == 1
    everything = torch.cat([torch.cat(list(s)) for s in shards])
    per_rank = math.ceil(n / world_size)
    assert len(everything) == per_rank * world_size
    assert set(everything.tolist()) == set(range(n))
    # Only the padding repeats samples: at most world_size - 1 of them, each once.
    counts = torch.bincount(everything, minlength=n)
    assert counts.max() <= 2 and int((counts - 1).sum()) == per_rank * world_size - n < world_size

    if n // world_size >= batch_size:
        exact = [ShardedBatches(n, batch_size, r, world_size, seed=1, drop_last=True) for r in range(world_size)]
        kept = torch.cat([torch.cat(list(s)) for s in exact])
        assert len(kept) == len(set(kept.tolist())) == world_size * len(exact[0]) * batch_size
        assert all(len(b) == batch_size for s in exact for b in s)


def test_sharding_reshuffles_per_epoch_and_repeats_per_seed():
    def epoch_order(seed, epoch):
        batches = ShardedBatches(50, 4, 1, 2, seed=seed)
        batches.set_epoch(epoch)
        return torch.cat(list(batches)).tolist()

    assert epoch_order(0, 0) == epoch_order(0, 0)
    assert epoch_order(0, 0) != epoch_order(0, 1)
    assert epoch_order(0, 0) != epoch_order(1, 0)
    unshuffled = ShardedBatches(10, 3, 1, 2, shuffle=False)
    assert torch.cat(list(unshuffled)).tolist() == [1, 3, 5, 7, 9]


def test_sharding_iterates_the_current_epoch_again():
    batches = ShardedBatches(20, 3, 0, 2, seed=2)
    batches.set_epoch(4)
    first, second = torch.cat(list(batches)), torch.cat(list(batches))
    assert torch.equal(first, second)


def test_sharding_resume_mid_epoch():
    def run(batches, epochs):
        seen = []
        for epoch in epochs:
            batches.set_epoch(epoch)
            seen += [(epoch, b.tolist()) for b in batches]
        return seen

    uninterrupted = run(ShardedBatches(37, 4, 1, 3, seed=9), range(3))

    interrupted = ShardedBatches(37, 4, 1, 3, seed=9)
    seen = run(interrupted, [0])
    interrupted.set_epoch(1)
    iterator = iter(interrupted)
    seen += [(1, next(iterator).tolist()) for _ in range(2)]
    checkpoint = interrupted.state_dict()
    assert (checkpoint["epoch"], checkpoint["position"]) == (1, 2)

    resumed = ShardedBatches(37, 4, 1, 3, seed=9)
    resumed.load_state_dict(checkpoint)
    seen += run(resumed, range(checkpoint["epoch"], 3))
    assert seen == uninterrupted


def test_sharding_resume_after_a_finished_epoch():
    batches = ShardedBatches(30, 4, 0, 2, seed=0)
    batches.set_epoch(2)
    list(batches)
    checkpoint = batches.state_dict()
    assert checkpoint["position"] == len(batches)
    resumed = ShardedBatches(30, 4, 0, 2, seed=0)
    resumed.load_state_dict(checkpoint)
    resumed.set_epoch(2)
    assert list(resumed) == []
    resumed.set_epoch(3)
    reference = ShardedBatches(30, 4, 0, 2, seed=0)
    reference.set_epoch(3)
    assert [b.tolist() for b in resumed] == [b.tolist() for b in reference]


def test_sharding_state_after_set_epoch_starts_at_zero():
    batches = ShardedBatches(30, 4, 0, 2)
    list(batches)
    batches.set_epoch(1)
    assert (batches.state_dict()["epoch"], batches.state_dict()["position"]) == (1, 0)
    iter(batches)
    assert batches.state_dict()["position"] == 0


def test_sharding_resumes_at_another_world_size_with_the_same_samples_per_batch():
    """Batch i of every rank holds the same positions of the permutation at any world size with the same
    samples per batch over all ranks: a run resumed at 1 rank x 8 continues 2 ranks x 4 with the same samples."""
    two = [ShardedBatches(50, 4, rank, 2, seed=3, drop_last=True) for rank in range(2)]
    batches = [list(sampler) for sampler in two]
    stopped = ShardedBatches(50, 4, 0, 2, seed=3, drop_last=True)
    iterator = iter(stopped)
    next(iterator), next(iterator)
    one = ShardedBatches(50, 8, 0, 1, seed=3, drop_last=True)
    one.load_state_dict(stopped.state_dict())
    rest = list(one)
    assert len(rest) == len(batches[0]) - 2
    for i, batch in enumerate(rest, start=2):
        assert sorted(batch.tolist()) == sorted(batches[0][i].tolist() + batches[1][i].tolist())


def test_sharding_rejects_mismatched_checkpoint_and_bad_arguments():
    checkpoint = ShardedBatches(30, 4, 0, 2, seed=0).state_dict()
    with pytest.raises(ValueError, match="checkpoint has seed=0, this run 1"):
        ShardedBatches(30, 4, 0, 2, seed=1).load_state_dict(checkpoint)
    with pytest.raises(ValueError, match="hold 4 samples on each of 2 ranks, this run's 4 on each of 3"):
        ShardedBatches(30, 4, 0, 3, seed=0).load_state_dict(checkpoint)
    with pytest.raises(ValueError, match="position 99"):
        ShardedBatches(30, 4, 0, 2, seed=0).load_state_dict({**checkpoint, "position": 99})
    with pytest.raises(ValueError, match="rank 2 is not in"):
        ShardedBatches(30, 4, 2, 2)
    with pytest.raises(ValueError, match=">= 1"):
        ShardedBatches(30, 0, 0, 2)


def test_iter_batches_gathers_tensors():
    x = torch.arange(26).view(13, 2) * 10
    y = torch.arange(13)
    batches = ShardedBatches(13, 3, 1, 2, seed=4)
    for (bx, by), indices in zip(batches.iter_batches(x, y), list(batches)):
        assert torch.equal(by, indices) and torch.equal(bx, x[indices])
    with pytest.raises(ValueError, match="12 rows"):
        next(batches.iter_batches(x[:12]))
