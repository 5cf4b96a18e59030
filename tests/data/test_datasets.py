"""Tests for optkit/data/datasets.py: the readers, splits and normalization behind each dataset spec."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest
import torch
from PIL import Image

from optkit.core.errors import DataError
from optkit.data import datasets as data
from optkit.data.specs import DatasetInfo, dataset_info

FMNIST = Path(data.FASHION_MNIST_DIR)
requires_fmnist = pytest.mark.skipif(not (FMNIST / "train-images-idx3-ubyte.gz").exists(),
                                     reason="Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)")


@requires_fmnist
def test_fashion_mnist_splits_and_normalization():
    train = data.load_dataset("fashion-mnist", "train")
    val = data.load_dataset("fashion-mnist", "val")
    test = data.load_dataset("fashion-mnist", "test")
    assert (len(train), len(val), len(test)) == (60000 - data.VAL_SIZE, data.VAL_SIZE, 10000)
    image, label = test[0]
    assert image.shape == (1, 28, 28) and image.dtype == torch.float32 and 0 <= label < 10
    # Un-augmented images normalized with the dataset's statistics: mean ~0, std ~1.
    images = torch.stack([val[i][0] for i in range(2000)])
    assert abs(images.mean().item()) < 0.05 and abs(images.std().item() - 1.0) < 0.05
    assert dataset_info("fashion-mnist") == DatasetInfo(10, 1, (28, 28), (0.2860,), (0.3530,))


@requires_fmnist
def test_fashion_mnist_val_is_held_out_and_deterministic():
    train, val = data.load_dataset("fashion-mnist", "train"), data.load_dataset("fashion-mnist", "val")
    again = data.load_dataset("fashion-mnist", "val", seed=0)
    other = data.load_dataset("fashion-mnist", "val", seed=1)
    assert torch.equal(val.images, again.images)
    assert not torch.equal(val.images, other.images)
    train_rows = {bytes(img.numpy()) for img in train.images[:: 50]}
    assert not train_rows & {bytes(img.numpy()) for img in val.images}


@requires_fmnist
def test_mean_std_override():
    ds = data.load_dataset("fashion-mnist", "test", mean=0.0, std=1.0)
    image, _ = ds[0]
    assert image.min() >= 0.0 and image.max() <= 1.0


@pytest.mark.parametrize("broken", ["truncated", "bad_magic", "missing"])
def test_malformed_fashion_mnist_says_how_to_get_it(tmp_path, broken):
    raw = (2051).to_bytes(4, "big") + b"".join(n.to_bytes(4, "big") for n in (2, 28, 28)) + bytes(2 * 784)
    if broken == "truncated":
        raw = raw[:-10]
    if broken == "bad_magic":
        raw = (1234).to_bytes(4, "big") + raw[4:]
    if broken != "missing":
        (tmp_path / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(raw))
    with pytest.raises(DataError, match="apt-get install dataset-fashion-mnist"):
        data.load_dataset(f"fashion-mnist:{tmp_path}", "train")


def _idx(images: torch.Tensor, labels: torch.Tensor) -> tuple[bytes, bytes]:
    header = (2051).to_bytes(4, "big") + b"".join(n.to_bytes(4, "big") for n in images.shape)
    label_header = (2049).to_bytes(4, "big") + len(labels).to_bytes(4, "big")
    return header + images.numpy().tobytes(), label_header + labels.numpy().tobytes()


def test_fashion_mnist_from_a_directory(tmp_path):
    images = torch.randint(0, 256, (40, 28, 28), dtype=torch.uint8)
    labels = torch.randint(0, 10, (40,), dtype=torch.uint8)
    image_bytes, label_bytes = _idx(images, labels)
    for split in ("train", "t10k"):
        (tmp_path / f"{split}-images-idx3-ubyte.gz").write_bytes(gzip.compress(image_bytes))
        (tmp_path / f"{split}-labels-idx1-ubyte.gz").write_bytes(gzip.compress(label_bytes))
    train = data.load_dataset(f"fashion-mnist:{tmp_path}", "train")
    val = data.load_dataset(f"fashion-mnist:{tmp_path}", "val")
    test = data.load_dataset(f"fashion-mnist:{tmp_path}", "test", mean=0.0, std=1.0)
    assert (len(train), len(val), len(test)) == (36, 4, 40)
    torch.testing.assert_close(test[3][0][0], images[3].float() / 255)
    assert test[3][1] == int(labels[3])


def test_mnist_through_torchvision(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    images = torch.randint(0, 256, (20, 28, 28), dtype=torch.uint8)
    labels = torch.randint(0, 10, (20,), dtype=torch.uint8)
    image_bytes, label_bytes = _idx(images, labels)
    for split in ("train", "t10k"):
        (raw / f"{split}-images-idx3-ubyte").write_bytes(image_bytes)
        (raw / f"{split}-labels-idx1-ubyte").write_bytes(label_bytes)
    test = data.load_dataset(f"mnist:{tmp_path}", "test")
    assert len(test) == 20 and len(data.load_dataset(f"mnist:{tmp_path}", "train")) == 18
    expected = (images[0].float() / 255 - 0.1307) / 0.3081
    torch.testing.assert_close(test[0][0][0], expected)


def test_synthetic_is_deterministic_and_shaped():
    ds = data.load_dataset("synthetic:16:1x8x12:3", "test")
    again = data.load_dataset("synthetic:16:1x8x12:3", "test")
    assert len(ds) == 16 and ds[0][0].shape == (1, 8, 12)
    assert torch.equal(ds.images, again.images) and set(ds.labels.tolist()) <= {0, 1, 2}
    assert not torch.equal(ds.images, data.load_dataset("synthetic:16:1x8x12:3", "val").images)
    assert dataset_info("synthetic:16:1x8x12:3").input_shape(4) == (4, 1, 8, 12)
    assert data.load_dataset("synthetic:4", "train")[0][0].shape == (3, 32, 32)


def test_augmentation_only_for_train():
    train = data.load_dataset("synthetic:8:1x8x8:2", "train")
    val = data.load_dataset("synthetic:8:1x8x8:2", "val")
    assert train.pad > 0 and train.flip
    assert val.pad == 0 and not val.flip
    torch.manual_seed(0)
    batch = train.__getitems__(list(range(8)))
    assert len(batch) == 8 and batch[0][0].shape == (1, 8, 8)


def test_random_crop_is_a_shifted_window():
    images = torch.arange(2 * 5 * 5, dtype=torch.uint8).reshape(2, 1, 5, 5).numpy()
    cropped = data._random_crop(images, 1)
    assert cropped.shape == images.shape
    for out, src in zip(cropped, images):
        padded = torch.nn.functional.pad(torch.from_numpy(src), (1, 1, 1, 1))
        windows = [padded[:, y:y + 5, x:x + 5] for y in range(3) for x in range(3)]
        assert any(torch.equal(torch.from_numpy(out.copy()), w) for w in windows)


@pytest.mark.parametrize("spec", ["synthetic:x", "synthetic:4:3x3:1", "nope:1", "mnist", "imagefolder"])
def test_bad_specs(spec):
    with pytest.raises(DataError):
        data.load_dataset(spec, "train")


def test_bad_split():
    with pytest.raises(DataError, match="train, val, test"):
        data.load_dataset("synthetic:4", "validation")


@pytest.mark.parametrize("kind", ["mnist", "cifar10"])
def test_torchvision_dataset_missing(kind, tmp_path):
    with pytest.raises(DataError, match=f"{kind} not found under"):
        data.load_dataset(f"{kind}:{tmp_path}", "train")


def _write_images(folder: Path, count: int, color: tuple[int, int, int]) -> None:
    folder.mkdir(parents=True)
    for i in range(count):
        Image.new("RGB", (20 + i, 16), color).save(folder / f"{i}.png")


def test_image_folder_flat(tmp_path):
    _write_images(tmp_path / "cat", 10, (255, 0, 0))
    _write_images(tmp_path / "dog", 10, (0, 0, 255))
    info = dataset_info(f"imagefolder:{tmp_path}")
    assert (info.num_classes, info.channels, info.image_size) == (2, 3, (224, 224))
    train = data.load_dataset(f"imagefolder:{tmp_path}", "train")
    val = data.load_dataset(f"imagefolder:{tmp_path}", "val")
    assert len(train) == 18 and len(val) == 2
    image, label = val[0]
    assert image.shape == (3, 224, 224) and label in (0, 1)


def test_image_folder_with_split_folders(tmp_path):
    for split in ("train", "val"):
        _write_images(tmp_path / split / "a", 3, (10, 200, 10))
        _write_images(tmp_path / split / "b", 2, (200, 10, 10))
    assert len(data.load_dataset(f"imagefolder:{tmp_path}", "val")) == 5
    assert dataset_info(f"imagefolder:{tmp_path}").num_classes == 2


def test_image_folder_empty_or_missing(tmp_path):
    with pytest.raises(DataError, match="no class sub-folders"):
        data.load_dataset(f"imagefolder:{tmp_path}", "train")
    (tmp_path / "cat").mkdir()
    with pytest.raises(DataError, match="no readable images"):
        data.load_dataset(f"imagefolder:{tmp_path}", "train")
    with pytest.raises(DataError, match="not found"):
        dataset_info(f"imagefolder:{tmp_path / 'nope'}")
