"""Datasets as in-memory tensors, batched augmentation, and per-rank shards of shuffled batches.

* ``load_dataset(name)`` returns a whole split as ``(images uint8 [N, C, H, W], labels int64 [N])``
  for ``"fashion_mnist"`` (IDX files of the Debian package ``dataset-fashion-mnist``), ``"cifar10"``
  and ``"cifar100"`` (the official python-pickle archives, read extracted or straight from the
  ``.tar.gz``). ``dataset_info(name)`` gives the shape, class count and normalisation constants.
* ``normalize`` and ``random_crop_flip`` transform whole batches with tensor ops, on any device.
* ``ShardedBatches`` is ``DistributedSampler`` + ``DataLoader(batch_size)`` for tensors already in
  memory: every rank gets an equal, disjoint share of a fresh permutation each epoch, and its
  ``state_dict`` resumes a run mid-epoch.

The datasets are small enough (at most 60000 x 3072 bytes) that every rank holds a whole split in
memory and indexes it; no worker processes or per-sample Python code are involved.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib
import io
import math
import os
import pickle
import struct
import tarfile
import urllib.request
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm

from ..atomic import write_atomically

PathLike = str | os.PathLike

FASHION_MNIST_ROOT = "/usr/share/datasets/fashion-mnist"
"""Where ``apt-get install dataset-fashion-mnist`` puts the IDX files; env ``DDPKIT_FASHION_MNIST`` overrides it."""

DATA_ROOT = "./data"
"""Where the CIFAR archives are looked for and downloaded to; env ``DDPKIT_DATA`` overrides it."""


@dataclass(frozen=True)
class DatasetInfo:
    """What a model and the transforms need to know about a dataset.

    ``mean``/``std`` are the published per-channel statistics of the training split, on pixel
    values scaled to [0, 1]; ``normalize(images, info.mean, info.std)`` uses them.
    """

    name: str
    channels: int
    num_classes: int
    image_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]


DATASETS = {
    "fashion_mnist": DatasetInfo(
        "fashion_mnist", channels=1, num_classes=10, image_size=28, mean=(0.2860,), std=(0.3530,)
    ),
    "cifar10": DatasetInfo(
        "cifar10",
        channels=3,
        num_classes=10,
        image_size=32,
        mean=(0.4914, 0.4822, 0.4465),
        std=(0.2470, 0.2435, 0.2616),
    ),
    "cifar100": DatasetInfo(
        "cifar100",
        channels=3,
        num_classes=100,
        image_size=32,
        mean=(0.5071, 0.4865, 0.4409),
        std=(0.2673, 0.2564, 0.2762),
    ),
}


def dataset_name(name: str) -> str:
    """The registry's name for ``name``, written as people write it: case, ``-``, ``_`` and spaces do
    not matter (``"fashion-mnist"``, ``"FashionMNIST"`` -> ``"fashion_mnist"``; ``"CIFAR-10"`` ->
    ``"cifar10"``). Raises ``ValueError`` naming the datasets for any other name."""
    key = "".join(ch for ch in str(name).lower() if ch not in "-_ ")
    for canonical in DATASETS:
        if key == canonical.replace("_", ""):
            return canonical
    raise ValueError(
        f"ddpkit: unknown dataset {name!r}; expected one of {sorted(DATASETS)} ('-' or '_' and case as you like)"
    )


def dataset_info(name: str) -> DatasetInfo:
    """The ``DatasetInfo`` of ``name`` (any spelling ``dataset_name`` accepts)."""
    return DATASETS[dataset_name(name)]


def load_dataset(
    name: str, root: PathLike | None = None, train: bool = True, download: bool = False
) -> tuple[Tensor, Tensor]:
    """One split of dataset ``name`` as ``(images uint8 [N, C, H, W], labels int64 [N])``.

    ``root`` means what it means for the dataset's loader: the directory holding the IDX files for
    Fashion-MNIST (``load_fashion_mnist``), the directory holding ``cifar-10-batches-py`` or its
    archive for CIFAR (``load_cifar``). ``download`` applies to CIFAR only: Fashion-MNIST comes from
    the Debian package, and its loader's error says how to install it. ``name`` may be spelt as
    ``dataset_name`` accepts (``"fashion-mnist"``, ``"cifar-10"``).
    """
    info = dataset_info(name)
    if info.name == "fashion_mnist":
        return load_fashion_mnist(root, train)
    return load_cifar(info.name, root, train, download)


# ----------------------------------------------------------------------------------------------
# Fashion-MNIST (IDX files)

_IDX_UBYTE = 0x08
_IDX_LABELS_MAGIC = 0x00000801
_IDX_IMAGES_MAGIC = 0x00000803
_FASHION_MNIST_FILES = {
    True: ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    False: ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def read_idx(path: PathLike) -> Tensor:
    """The array of an IDX file of unsigned bytes (raw or gzip-compressed) as a uint8 tensor.

    The header is a big-endian magic ``0x000008DD`` (``DD`` = number of dimensions), then ``DD``
    big-endian uint32 sizes; the shape of the result is those sizes. A header of another element
    type, or a data section shorter or longer than the sizes promise, raises ``ValueError``.
    """
    path = Path(path)
    with open(path, "rb") as file:
        compressed = file.read(2) == b"\x1f\x8b"  # gzip's magic; an IDX file starts with two zero bytes
    try:
        with gzip.open(path, "rb") if compressed else open(path, "rb") as file:
            data = bytearray(file.read())
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise ValueError(f"ddpkit: {path}: corrupt gzip stream ({exc})") from None
    if len(data) < 4:
        raise ValueError(f"ddpkit: {path}: {len(data)} bytes is too short for an IDX header")
    (magic,) = struct.unpack(">I", data[:4])
    ndim = magic & 0xFF
    if magic >> 8 != _IDX_UBYTE or ndim == 0:
        raise ValueError(
            f"ddpkit: {path}: magic number 0x{magic:08x} is not that of an IDX file of unsigned "
            f"bytes (0x{_IDX_LABELS_MAGIC:08x} for labels, 0x{_IDX_IMAGES_MAGIC:08x} for images)"
        )
    header_size = 4 + 4 * ndim
    if len(data) < header_size:
        raise ValueError(
            f"ddpkit: {path}: truncated IDX header ({len(data)} bytes, {ndim} dimensions need {header_size})"
        )
    shape = struct.unpack(f">{ndim}I", data[4:header_size])
    expected, found = math.prod(shape), len(data) - header_size
    if found != expected:
        problem = "truncated" if found < expected else "has trailing bytes"
        raise ValueError(
            f"ddpkit: {path}: {problem}: the header promises shape {list(shape)} = {expected} bytes "
            f"of data, the file holds {found}"
        )
    return torch.from_numpy(np.frombuffer(data, dtype=np.uint8, offset=header_size).reshape(shape))


def load_fashion_mnist(root: PathLike | None = None, train: bool = True) -> tuple[Tensor, Tensor]:
    """Fashion-MNIST's train (60000) or test (10000) split: ``(uint8 [N, 1, 28, 28], int64 [N])``.

    ``root`` (default: env ``DDPKIT_FASHION_MNIST``, else ``FASHION_MNIST_ROOT``) holds
    ``{train,t10k}-{images-idx3,labels-idx1}-ubyte``, each raw or gzipped with a ``.gz`` suffix.
    """
    root = Path(root if root is not None else os.environ.get("DDPKIT_FASHION_MNIST", FASHION_MNIST_ROOT))
    image_path, label_path = (_find_idx_file(root, name) for name in _FASHION_MNIST_FILES[train])
    images, labels = read_idx(image_path), read_idx(label_path)
    if images.dim() != 3 or images.shape[1:] != (28, 28):
        raise ValueError(
            f"ddpkit: {image_path}: expected Fashion-MNIST images (magic 0x{_IDX_IMAGES_MAGIC:08x}, "
            f"shape [N, 28, 28]), found magic 0x{0x800 + images.dim():08x} with shape "
            f"{list(images.shape)}"
        )
    if labels.dim() != 1:
        raise ValueError(
            f"ddpkit: {label_path}: expected Fashion-MNIST labels (magic 0x{_IDX_LABELS_MAGIC:08x}, "
            f"shape [N]), found magic 0x{0x800 + labels.dim():08x} with shape {list(labels.shape)}"
        )
    if len(images) != len(labels):
        raise ValueError(f"ddpkit: {image_path} holds {len(images)} images but {label_path} holds {len(labels)} labels")
    labels = labels.long()
    _check_labels(labels, DATASETS["fashion_mnist"].num_classes, str(label_path))
    return images.unsqueeze(1), labels


def _find_idx_file(root: Path, name: str) -> Path:
    candidates = [root / name, root / f"{name}.gz"]
    for path in candidates:
        if path.is_file():
            return path
    where = (
        f"directory {root} does not exist"
        if not root.is_dir()
        else f"neither {candidates[0]} nor {candidates[1]} exists"
    )
    raise FileNotFoundError(
        f"ddpkit: Fashion-MNIST not found: {where}. Install it with `apt-get install dataset-fashion-mnist` "
        f"(files go to {FASHION_MNIST_ROOT}), or point the root argument or the DDPKIT_FASHION_MNIST "
        "environment variable at a directory holding {train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]"
    )


def _check_labels(labels: Tensor, num_classes: int, origin: str) -> None:
    if len(labels) and not (labels.min() >= 0 and labels.max() < num_classes):
        raise ValueError(
            f"ddpkit: {origin}: labels span [{int(labels.min())}, {int(labels.max())}], "
            f"expected classes 0..{num_classes - 1}"
        )


# ----------------------------------------------------------------------------------------------
# CIFAR-10 / CIFAR-100 (python-pickle archives)


@dataclass(frozen=True)
class _CifarSource:
    title: str
    directory: str  # the archive's top-level directory, also the name it is extracted to
    archive: str
    url: str
    md5: str
    train_batches: tuple[str, ...]
    test_batches: tuple[str, ...]
    label_key: bytes
    torchvision_class: str


_CIFAR_SOURCES = {
    "cifar10": _CifarSource(
        "CIFAR-10",
        "cifar-10-batches-py",
        "cifar-10-python.tar.gz",
        "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
        "c58f30108f718f92721af3b95e74349a",
        tuple(f"data_batch_{i}" for i in range(1, 6)),
        ("test_batch",),
        b"labels",
        "CIFAR10",
    ),
    "cifar100": _CifarSource(
        "CIFAR-100",
        "cifar-100-python",
        "cifar-100-python.tar.gz",
        "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
        "eb9058c3a382ffc7106e4002c42a8d85",
        ("train",),
        ("test",),
        b"fine_labels",
        "CIFAR100",
    ),
}

# Everything a CIFAR batch file may reference: numpy arrays (under numpy 1's and numpy 2's module
# names) and the bytes encoding of protocol-2 pickles. Unpickling anything else could run code.
_CIFAR_PICKLE_GLOBALS = frozenset(
    {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),
    }
)


class _CifarUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in _CIFAR_PICKLE_GLOBALS:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a CIFAR batch")
        return getattr(importlib.import_module(module), name)


def load_cifar(
    name: str, root: PathLike | None = None, train: bool = True, download: bool = False
) -> tuple[Tensor, Tensor]:
    """CIFAR-10 or CIFAR-100 (``name`` ``"cifar10"``/``"cifar100"``): ``(uint8 [N, 3, 32, 32], int64 [N])``.

    N is 50000 for train, 10000 for test; CIFAR-100's labels are its 100 fine classes. ``root``
    (default: env ``DDPKIT_DATA``, else ``DATA_ROOT``) holds the extracted directory
    (``cifar-10-batches-py``, ``cifar-100-python``) or the archive (``cifar-10-python.tar.gz``,
    ``cifar-100-python.tar.gz``); the directory is preferred. If neither exists and ``download`` is
    true, the archive is downloaded into ``root`` (by torchvision when it imports, which also
    extracts it), else ``FileNotFoundError`` says where to put it. With several processes on one
    file system, let one download before the others load.
    """
    if name not in _CIFAR_SOURCES:
        raise ValueError(f"ddpkit: unknown CIFAR dataset {name!r}; expected one of {sorted(_CIFAR_SOURCES)}")
    source = _CIFAR_SOURCES[name]
    root = Path(root if root is not None else os.environ.get("DDPKIT_DATA", DATA_ROOT))
    directory, archive = root / source.directory, root / source.archive
    if not directory.is_dir() and not archive.is_file():
        if not download:
            raise FileNotFoundError(_cifar_missing_message(source, root))
        try:
            _download_cifar(source, root)
        except Exception as exc:
            raise FileNotFoundError(_cifar_download_failed_message(source, root, exc)) from exc
    batch_names = source.train_batches if train else source.test_batches
    if directory.is_dir():
        batches = []
        for batch_name in batch_names:
            path = directory / batch_name
            if not path.is_file():
                raise FileNotFoundError(
                    f"ddpkit: {source.title} batch {path} is missing; the directory {directory} "
                    f"is incomplete (delete it and extract {source.archive} again)"
                )
            with open(path, "rb") as file:
                batches.append((_unpickle_cifar_batch(file, str(path)), str(path)))
    else:
        batches = _read_archive_batches(archive, source.directory, batch_names)
    decoded = [_decode_cifar_batch(batch, source.label_key, origin) for batch, origin in batches]
    images = torch.cat([images for images, _ in decoded])
    labels = torch.cat([labels for _, labels in decoded])
    _check_labels(labels, DATASETS[name].num_classes, f"{root} ({source.title})")
    return images, labels


def _cifar_missing_message(source: _CifarSource, root: Path) -> str:
    return (
        f"ddpkit: {source.title} not found: expected the directory {root / source.directory} or the archive "
        f"{root / source.archive}. Download it with --download (download=True), or fetch {source.url} "
        f"(md5 {source.md5}) yourself and put it in {root}, extracted or not; set the root argument or the "
        "DDPKIT_DATA environment variable to use another directory."
    )


def _cifar_download_failed_message(source: _CifarSource, root: Path, error: Exception) -> str:
    # The download was asked for and failed (no network, a proxy, a corrupt transfer): what is left is
    # bringing the archive in by hand.
    return (
        f"ddpkit: {source.title} not found in {root} and the download failed: {error}. Without network here, "
        f"download {source.url} on another machine, check its md5 is {source.md5}, and copy it to "
        f"{root / source.archive} (or extract it there as {root / source.directory}); then run again without "
        "--download. The DDPKIT_DATA environment variable or the root argument (--data-root) picks another "
        "directory."
    )


def _unpickle_cifar_batch(file, origin: str) -> dict:
    try:
        # The batches are Python 2 pickles: encoding="bytes" keeps their str keys as bytes (b"data").
        batch = _CifarUnpickler(file, encoding="bytes").load()
    except Exception as exc:  # corrupt bytes reach the allowed globals and pickle's opcodes with anything
        raise ValueError(f"ddpkit: {origin}: not a CIFAR batch pickle ({type(exc).__name__}: {exc})") from None
    if not isinstance(batch, dict):
        raise ValueError(f"ddpkit: {origin}: a CIFAR batch is a dict, found {type(batch).__name__}")
    return batch


def _read_archive_batches(archive: Path, top: str, batch_names: Sequence[str]) -> list[tuple[dict, str]]:
    wanted = {f"{top}/{name}": name for name in batch_names}
    found: dict[str, dict] = {}
    try:
        with tarfile.open(archive, "r:gz") as tar:
            # One sequential pass: random access into a gzip stream decompresses from the start each time.
            for member in tar:
                if member.name in wanted and member.isfile():
                    origin = f"{archive}:{member.name}"
                    found[member.name] = _unpickle_cifar_batch(io.BytesIO(tar.extractfile(member).read()), origin)
                    if len(found) == len(wanted):
                        break
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise ValueError(f"ddpkit: {archive} is not a readable .tar.gz ({exc}); delete it and download again") from None
    missing = [member for member in wanted if member not in found]
    if missing:
        raise ValueError(f"ddpkit: {archive} lacks {', '.join(missing)}; delete it and download again")
    return [(found[member], f"{archive}:{member}") for member in wanted]


def _decode_cifar_batch(batch: dict, label_key: bytes, origin: str) -> tuple[Tensor, Tensor]:
    data, labels = batch.get(b"data"), batch.get(label_key)
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        described = (
            f"{data.dtype} array of shape {list(data.shape)}" if isinstance(data, np.ndarray) else type(data).__name__
        )
        raise ValueError(f"ddpkit: {origin}: b'data' should be a uint8 array of shape [N, 3072], found {described}")
    if labels is None:
        raise ValueError(f"ddpkit: {origin}: the batch has no {label_key!r} entry (keys: {sorted(batch)})")
    labels = np.asarray(labels, dtype=np.int64)
    if labels.shape != (len(data),):
        raise ValueError(f"ddpkit: {origin}: {label_key!r} has shape {list(labels.shape)}, expected [{len(data)}]")
    # Each row is three channel planes (R, G, B), each 32 rows of 32 pixels: exactly [3, 32, 32].
    images = torch.from_numpy(np.ascontiguousarray(data)).reshape(len(data), 3, 32, 32)
    return images, torch.from_numpy(labels)


def _download_cifar(source: _CifarSource, root: Path) -> None:
    try:
        import torchvision.datasets
    except Exception:  # absent, or built for another torch (which fails in other ways than ImportError)
        download_url(source.url, root / source.archive, source.md5)
    else:
        getattr(torchvision.datasets, source.torchvision_class)(str(root), train=True, download=True)


def download_url(url: str, path: PathLike, md5: str) -> Path:
    """Downloads ``url`` to ``path`` and returns ``path``, which appears only complete and verified.

    The bytes go to a temporary file beside ``path``, renamed onto it once their md5 hex digest
    equals ``md5``; on a mismatch (``ValueError``) or any other failure the temporary file is
    removed and ``path`` is left as it was.
    """

    def fetch(out) -> None:
        digest = hashlib.md5()
        with urllib.request.urlopen(url, timeout=60) as response:
            length = response.headers.get("Content-Length")
            with tqdm(
                total=int(length) if length else None, unit="B", unit_scale=True, desc=Path(path).name, disable=None
            ) as progress:
                while chunk := response.read(1 << 20):
                    out.write(chunk)
                    digest.update(chunk)
                    progress.update(len(chunk))
        if digest.hexdigest() != md5.lower():
            raise ValueError(
                f"ddpkit: {url}: md5 {digest.hexdigest()} does not match the expected {md5} "
                "(corrupt or tampered download)"
            )

    return write_atomically(path, fetch)


# ----------------------------------------------------------------------------------------------
# Batched transforms


def normalize(images: Tensor, mean: Sequence[float], std: Sequence[float]) -> Tensor:
    """``(images / 255 - mean) / std`` per channel: uint8 ``[N, C, H, W]`` -> float32 ``[N, C, H, W]``.

    ``mean`` and ``std`` have ``C`` entries each, on the [0, 1] scale (``DatasetInfo.mean/std``).
    """
    if images.dtype != torch.uint8 or images.dim() != 4:
        raise ValueError(
            f"ddpkit: normalize expects a uint8 batch [N, C, H, W], got {images.dtype} {list(images.shape)}"
        )
    channels = images.shape[1]
    if len(mean) != channels or len(std) != channels:
        raise ValueError(f"ddpkit: normalize got {len(mean)} means and {len(std)} stds for {channels} channels")
    mean_t = torch.tensor(mean, dtype=torch.float32, device=images.device).view(1, channels, 1, 1)
    std_t = torch.tensor(std, dtype=torch.float32, device=images.device).view(1, channels, 1, 1)
    return images.float().div_(255).sub_(mean_t).div_(std_t)


def random_crop_flip(images: Tensor, padding: int = 4, generator: torch.Generator | None = None) -> Tensor:
    """Per image, a random ``H x W`` crop of the zero-padded image, mirrored left-right with probability 1/2.

    ``images`` is ``[N, C, H, W]`` of any dtype; the result has the same shape, dtype and device.
    Each image draws its own offsets in ``[0, 2 * padding]`` and its own flip, all from
    ``generator`` (default: torch's global generator), so a seeded generator gives the same batch.
    Apply it to uint8 images before ``normalize`` so the padding is black, as in the usual recipe.
    """
    if images.dim() != 4:
        raise ValueError(f"ddpkit: random_crop_flip expects a batch [N, C, H, W], got shape {list(images.shape)}")
    if padding < 0:
        raise ValueError(f"ddpkit: padding must be >= 0, got {padding}")
    n, _, height, width = images.shape
    draw_device = generator.device if generator is not None else images.device
    top = torch.randint(0, 2 * padding + 1, (n,), generator=generator, device=draw_device).to(images.device)
    left = torch.randint(0, 2 * padding + 1, (n,), generator=generator, device=draw_device).to(images.device)
    flip = torch.randint(0, 2, (n,), generator=generator, device=draw_device).to(images.device, torch.bool)
    padded = F.pad(images, (padding, padding, padding, padding))
    rows = top[:, None] + torch.arange(height, device=images.device)  # [N, H]
    columns = left[:, None] + torch.arange(width, device=images.device)  # [N, W]
    # Mirroring a crop is reading its columns right to left.
    columns = torch.where(flip[:, None], columns.flip(1), columns)
    batch = torch.arange(n, device=images.device)[:, None, None, None]
    channels = torch.arange(images.shape[1], device=images.device)[None, :, None, None]
    return padded[batch, channels, rows[:, None, :, None], columns[:, None, None, :]]


# ----------------------------------------------------------------------------------------------
# Sharded batches


class ShardedBatches:
    """This rank's batches of a dataset of ``num_samples`` in-memory samples, reshuffled every epoch.

    Per epoch, the same as ``DataLoader(batch_size=batch_size, drop_last=drop_last)`` over
    ``DistributedSampler(num_samples, world_size, rank, shuffle, seed, drop_last)`` after
    ``set_epoch(epoch)``: a permutation drawn from ``seed + epoch`` (identical on every rank) is
    dealt out round-robin, rank ``r`` taking positions ``r, r + world_size, ...``. Every rank gets
    the same number of samples and batches, so the ranks' collectives stay in step:

    * ``drop_last=False``: the permutation is padded with its own first indices up to a multiple
      of ``world_size`` (so up to ``world_size - 1`` samples appear twice per epoch); the last batch
      may be smaller than ``batch_size``, equally on every rank.
    * ``drop_last=True``: the permutation's tail beyond a multiple of ``world_size`` is dropped, and
      so is the last batch if it is not full: no sample repeats, every batch is full.

    Iterating yields int64 index tensors ``[batch]``; ``iter_batches(x, y)`` yields ``(x[i], y[i])``.
    Each iteration runs the current epoch from its first batch, except right after
    ``load_state_dict``: ``state_dict()`` records the epoch and how many of its batches were handed
    out, and the first iteration after restoring it continues right after them (a ``set_epoch`` of
    the same epoch keeps that position, of another epoch discards it). So a resumed run, calling
    ``set_epoch`` as usual, sees exactly the batches the interrupted one would have.
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        rank: int,
        world_size: int,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
    ):
        if num_samples < 1 or batch_size < 1 or world_size < 1:
            raise ValueError(
                f"ddpkit: ShardedBatches needs num_samples, batch_size and world_size >= 1, got "
                f"{num_samples}, {batch_size}, {world_size}"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"ddpkit: rank {rank} is not in [0, world_size={world_size})")
        self.num_samples, self.batch_size = num_samples, batch_size
        self.rank, self.world_size = rank, world_size
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        if drop_last:
            self.samples_per_rank = num_samples // world_size
            self._num_batches = self.samples_per_rank // batch_size
        else:
            self.samples_per_rank = math.ceil(num_samples / world_size)
            self._num_batches = math.ceil(self.samples_per_rank / batch_size)
        if self._num_batches == 0:
            raise ValueError(
                f"ddpkit: with drop_last, {num_samples} samples over {world_size} ranks do not fill one "
                f"batch of {batch_size} per rank"
            )
        self.epoch = 0
        self._position = 0  # batches of `epoch` handed out so far
        self._restored = False  # `_position` came from load_state_dict and no iteration has used it yet

    def __len__(self) -> int:
        """Batches per epoch on this rank (the same on every rank)."""
        return self._num_batches

    def set_epoch(self, epoch: int) -> None:
        """Makes the next iteration run epoch ``epoch`` from its first batch (see the class for resuming)."""
        if not (self._restored and epoch == self.epoch):
            self.epoch, self._position, self._restored = epoch, 0, False

    def indices(self) -> Tensor:
        """This rank's sample indices for the current epoch, in order: int64 ``[samples_per_rank]``."""
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.num_samples, generator=generator)
        else:
            order = torch.arange(self.num_samples)
        total = self.samples_per_rank * self.world_size
        if total > self.num_samples:
            order = order.repeat(math.ceil(total / self.num_samples))
        return order[self.rank : total : self.world_size]

    def __iter__(self) -> Iterator[Tensor]:
        # Not a generator itself: the position must reset when iteration starts, not at the first batch,
        # or a state_dict taken in between would describe the previous pass.
        start = self._position if self._restored else 0
        self._position, self._restored = start, False
        batches = self.indices()[: self._num_batches * self.batch_size].split(self.batch_size)
        return self._advance(batches, start)

    def _advance(self, batches: Sequence[Tensor], start: int) -> Iterator[Tensor]:
        for position in range(start, self._num_batches):
            self._position = position + 1
            yield batches[position]

    def iter_batches(self, *tensors: Tensor) -> Iterator[tuple[Tensor, ...]]:
        """Like iterating, but yields ``tuple(t[indices] for t in tensors)``; each tensor has ``num_samples`` rows."""
        for tensor in tensors:
            if len(tensor) != self.num_samples:
                raise ValueError(
                    f"ddpkit: a tensor of {len(tensor)} rows given to ShardedBatches over {self.num_samples} samples"
                )
        for indices in self:
            yield tuple(tensor[indices.to(tensor.device)] for tensor in tensors)

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "position": self._position,
            "num_samples": self.num_samples,
            "batch_size": self.batch_size,
            "world_size": self.world_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restores ``state_dict()``'s position; the order-determining settings must be the same. The world
        size may differ where the ranks' batches together hold as many samples (``batch_size x world_size``):
        batch i of every rank then holds positions [i * batch_size * world_size, (i + 1) * ...) of the
        epoch's permutation, the same samples at any world size."""
        for key in ("num_samples", "seed", "shuffle", "drop_last"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"ddpkit: cannot resume ShardedBatches: the checkpoint has {key}={state[key]!r}, "
                    f"this run {getattr(self, key)!r}"
                )
        if state["batch_size"] * state["world_size"] != self.batch_size * self.world_size:
            raise ValueError(
                f"ddpkit: cannot resume ShardedBatches: the checkpoint's batches hold {state['batch_size']} samples "
                f"on each of {state['world_size']} ranks, this run's {self.batch_size} on each of {self.world_size}"
            )
        if not 0 <= state["position"] <= self._num_batches:
            raise ValueError(f"ddpkit: checkpoint position {state['position']} is not in [0, {self._num_batches}]")
        self.epoch, self._position, self._restored = state["epoch"], state["position"], True
