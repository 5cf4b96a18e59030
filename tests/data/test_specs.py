"""Tests for optkit/data/specs.py: dataset specs, their normalization query and DatasetInfo."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest
import torch
from PIL import Image

import optkit
import optkit.data
from optkit.core.errors import DataError
from optkit.data import DatasetInfo, DataSpec, dataset_info, load_dataset, parse_spec

FMNIST = Path("/usr/share/datasets/fashion-mnist")


@pytest.mark.parametrize(("spec", "expected"), [
    ("fashion-mnist", DataSpec("fashion-mnist", "")),
    ("fashion-mnist?mean=0&std=1", DataSpec("fashion-mnist", "", (0.0,), (1.0,))),
    ("fashion-mnist:/data/fm?std=0.5", DataSpec("fashion-mnist", "/data/fm", None, (0.5,))),
    ("imagefolder:/x/y?mean=0.5,0.4,0.3&std=0.2,0.2,0.2",
     DataSpec("imagefolder", "/x/y", (0.5, 0.4, 0.3), (0.2, 0.2, 0.2))),
    ("synthetic:16:1x8x8:3?mean=0.1", DataSpec("synthetic", "16:1x8x8:3", (0.1,), None)),
])
def test_parse_spec_reads_the_query_after_any_spec(spec, expected):
    parsed = parse_spec(spec)
    assert parsed == expected
    assert parsed.base == spec.partition("?")[0]


@pytest.mark.parametrize("query", ["scale=2", "mean=0&shift=1", "", "Mean=0"])
def test_unknown_query_keys_are_one_line_listing_the_valid_ones(query):
    with pytest.raises(DataError) as caught:
        dataset_info(f"synthetic:4?{query}")
    message = str(caught.value)
    assert "\n" not in message and "valid keys: mean, std" in message


@pytest.mark.parametrize(("query", "message"), [
    ("mean=abc", "must be one number or one per channel"),
    ("mean=", "must be one number or one per channel"),
    ("std", "must be one number or one per channel"),
    ("mean=0&mean=1", "mean is given twice"),
    ("std=0", "std values must be positive"),
    ("mean=0.1,0.2", "mean needs 1 or 3 values for 3-channel images, got 2"),
])
def test_bad_normalization_values_are_data_errors(query, message):
    with pytest.raises(DataError, match=message):
        dataset_info(f"synthetic:4:3x8x8?{query}")


def test_dataset_info_exposes_the_effective_normalization_per_channel():
    assert dataset_info("fashion-mnist") == DatasetInfo(10, 1, (28, 28), (0.2860,), (0.3530,))
    plain = dataset_info("fashion-mnist?mean=0&std=1")
    assert (plain.mean, plain.std) == ((0.0,), (1.0,))
    assert plain.normalization() == {"mean": "0", "std": "1"}
    default = dataset_info("synthetic:4:3x8x8")
    assert (default.mean, default.std) == ((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    half = dataset_info("synthetic:4:3x8x8?std=0.5")
    assert (half.mean, half.std) == ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    assert dataset_info("synthetic:4:3x8x8?mean=0.1,0.2,0.3").normalization()["mean"] == "0.1,0.2,0.3"


def test_query_sets_the_images_normalization():
    raw = load_dataset("synthetic:8:1x4x4:2", "test").images.float()
    plain = load_dataset("synthetic:8:1x4x4:2?mean=0&std=1", "test")
    default = load_dataset("synthetic:8:1x4x4:2", "test")
    torch.testing.assert_close(plain[3][0], raw[3] / 255, rtol=0, atol=1e-6)
    torch.testing.assert_close(default[3][0], (raw[3] / 255 - 0.5) / 0.25, rtol=0, atol=1e-5)


def test_explicit_mean_and_std_win_over_the_query():
    raw = load_dataset("synthetic:8:1x4x4:2", "test").images.float()
    ds = load_dataset("synthetic:8:1x4x4:2?mean=0&std=1", "test", mean=0.5, std=0.5)
    torch.testing.assert_close(ds[0][0], (raw[0] / 255 - 0.5) / 0.5, rtol=0, atol=1e-5)


def test_fashion_mnist_directory_with_a_query(tmp_path):
    images = torch.randint(0, 256, (20, 28, 28), dtype=torch.uint8)
    labels = torch.randint(0, 10, (20,), dtype=torch.uint8)
    image_header = (2051).to_bytes(4, "big") + b"".join(n.to_bytes(4, "big") for n in images.shape)
    label_header = (2049).to_bytes(4, "big") + len(labels).to_bytes(4, "big")
    for split in ("train", "t10k"):
        (tmp_path / f"{split}-images-idx3-ubyte.gz").write_bytes(gzip.compress(image_header + images.numpy().tobytes()))
        (tmp_path / f"{split}-labels-idx1-ubyte.gz").write_bytes(gzip.compress(label_header + labels.numpy().tobytes()))
    test = load_dataset(f"fashion-mnist:{tmp_path}?mean=0&std=1", "test")
    torch.testing.assert_close(test[5][0][0], images[5].float() / 255, rtol=0, atol=1e-6)


def test_image_folder_normalization_from_the_query(tmp_path):
    for name, color in (("red", (255, 0, 0)), ("blue", (0, 0, 255))):
        (tmp_path / name).mkdir()
        for i in range(10):
            Image.new("RGB", (30, 30), color).save(tmp_path / name / f"{i}.png")
    spec = f"imagefolder:{tmp_path}?mean=0.5,0.5,0.5&std=0.5,0.5,0.5"
    assert dataset_info(spec).normalization() == {"mean": "0.5,0.5,0.5", "std": "0.5,0.5,0.5"}
    image, label = load_dataset(spec, "val")[0]
    # A solid colour: channel 1.0 -> (1 - 0.5) / 0.5 = 1, channel 0.0 -> -1.
    expected = torch.tensor([1.0, -1.0, -1.0] if label == 1 else [-1.0, -1.0, 1.0])
    torch.testing.assert_close(image.mean(dim=(1, 2)), expected, rtol=0, atol=1e-6)


@pytest.mark.skipif(not (FMNIST / "t10k-images-idx3-ubyte.gz").exists(), reason="Fashion-MNIST not installed")
def test_fashion_mnist_as_plain_zero_one_tensors():
    ds = load_dataset("fashion-mnist?mean=0&std=1", "test")
    images = torch.stack([ds[i][0] for i in range(1000)])
    raw = ds.images[:1000].float() / 255
    assert images.min() >= 0.0 and images.max() <= 1.0
    torch.testing.assert_close(images, raw, rtol=0, atol=1e-6)


def test_package_reexports_the_public_names():
    from optkit.data import datasets, loader, specs

    assert optkit.data.parse_spec is specs.parse_spec and optkit.data.DatasetInfo is specs.DatasetInfo
    assert optkit.data.load_dataset is datasets.load_dataset
    assert optkit.data.make_loader is loader.make_loader
    assert optkit.dataset_info is specs.dataset_info and optkit.make_loader is loader.make_loader
