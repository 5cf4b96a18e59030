"""The segfolder: and coco: specs: layout checks, the split by file name, resizing, masks, letterboxed boxes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from optkit.core.errors import DataError
from optkit.data import DataSpec, check_available, dataset_info, load_dataset, parse_spec
from optkit.data.coco import read_coco
from optkit.data.segfolder import read_segfolder
from optkit.data.specs import IMAGENET_MEAN, IMAGENET_STD
from optkit.data.splits import SPLIT_BOUNDS, name_split, split_names
from optkit.data.text import read_documents
from tests.support.dense_data import LEFT, RIGHT, VOID, names_in, split_counts, write_coco, write_segfolder


def one_line_error(call, fragment: str) -> str:
    with pytest.raises(DataError) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message and fragment in message, message
    return message


# --- specs and splits -------------------------------------------------------------------------------------------

def test_specs_parse_and_only_segfolder_takes_a_normalization():
    assert parse_spec("segfolder:/d?mean=0&std=1") == DataSpec("segfolder", "/d", (0.0,), (1.0,))
    assert parse_spec("coco:/d") == DataSpec("coco", "/d")
    one_line_error(lambda: parse_spec("coco:/d?mean=0"), "coco specs take no query")
    one_line_error(lambda: parse_spec("segfolder"), "needs an argument")
    one_line_error(lambda: parse_spec("voc:/d"), "segfolder:DIR, coco:DIR")


@pytest.mark.parametrize("spec", ["segfolder:/d", "coco:/d"])
def test_masks_and_boxes_are_not_labelled_images(spec):
    one_line_error(lambda: dataset_info(spec), "not labelled images")
    one_line_error(lambda: load_dataset(spec, "test"), "not labelled images")


def test_the_split_is_the_text_specs_hash_of_the_file_name(tmp_path):
    names = [f"img{i:03d}.png" for i in range(400)]
    parts = {split: split_names(names, split, "x") for split in SPLIT_BOUNDS}
    assert sorted(sum(parts.values(), [])) == names
    assert all(name_split(name) == split for split, part in parts.items() for name in part)
    assert 0.8 < len(parts["train"]) / len(names) < 0.97 and parts["test"] and parts["val"]
    # The text specs split their files by the same rule.
    for i in range(60):
        (tmp_path / f"doc{i:02d}.txt").write_text(f"document {i}\n", encoding="utf-8")
    expected = [f"document {i}\n" for i in range(60) if name_split(f"doc{i:02d}.txt") == "test"]
    assert read_documents(str(tmp_path), "test") == expected


def test_a_folder_too_small_for_the_hash_is_split_by_name_order():
    # Five names the hash puts in train: the last by name is test, the one before it val.
    names = names_in("train", 5)
    parts = {split: split_names(list(reversed(names)), split, "x") for split in SPLIT_BOUNDS}
    assert parts == {"train": names[:3], "val": [names[3]], "test": [names[4]]}
    one_line_error(lambda: split_names(["a.png", "b.png"], "test", "segfolder:/d"), "needs at least 3")
    one_line_error(lambda: split_names(names, "dev", "x"), "split must be one of")


# --- segmentation folders ---------------------------------------------------------------------------------------

def test_segfolder_reads_the_test_images_resized_with_masks_resized_by_nearest_neighbour(tmp_path):
    splits = split_counts(train=2, val=1, test=3)
    root = write_segfolder(tmp_path / "seg", sum(splits.values(), []), size=(32, 24))
    images, masks = read_segfolder(f"segfolder:{root}", "test", (1, 3, 12, 16), samples=10)
    assert images.shape == (3, 3, 12, 16) and images.dtype == torch.float32
    assert masks.shape == (3, 12, 16) and masks.dtype == torch.uint8
    # Nearest neighbour never blends class indices: the left half is LEFT, the right half RIGHT.
    assert set(masks.unique().tolist()) <= {LEFT, RIGHT, VOID}
    assert set(masks[:, 1:, :8].unique().tolist()) == {LEFT} and set(masks[:, 1:, 8:].unique().tolist()) == {RIGHT}
    # ImageNet normalization by default: red 200 on the left, blue 200 on the right.
    red = (200 / 255 - IMAGENET_MEAN[0]) / IMAGENET_STD[0]
    assert images[:, 0, 4:, :6].flatten().tolist() == pytest.approx([red] * (3 * 8 * 6), abs=1e-5)
    blue = (200 / 255 - IMAGENET_MEAN[2]) / IMAGENET_STD[2]
    assert images[:, 2, 4:, 10:].flatten().tolist() == pytest.approx([blue] * (3 * 8 * 6), abs=1e-5)
    plain, _ = read_segfolder(f"segfolder:{root}?mean=0&std=1", "test", (1, 3, 12, 16), samples=1)
    assert float(plain[0, 0, 6, 2]) == pytest.approx(200 / 255, abs=1e-6)
    # samples keeps the first images by name; val holds its own.
    assert len(read_segfolder(f"segfolder:{root}", "test", (1, 3, 12, 16), samples=2)[0]) == 2
    assert len(read_segfolder(f"segfolder:{root}", "val", (1, 3, 12, 16), samples=10)[0]) == 1


def test_greyscale_and_palette_masks_read_the_same(tmp_path):
    names = sum(split_counts().values(), [])
    palette = read_segfolder(f"segfolder:{write_segfolder(tmp_path / 'p', names)}", "test", (1, 3, 12, 16), 9)[1]
    grey = read_segfolder(f"segfolder:{write_segfolder(tmp_path / 'g', names, palette=False)}", "test",
                          (1, 3, 12, 16), 9)[1]
    assert torch.equal(palette, grey)


def test_bad_segmentation_folders_are_one_line_errors(tmp_path):
    names = sum(split_counts().values(), [])
    one_line_error(lambda: check_available(f"segfolder:{tmp_path / 'missing'}"), "not found")
    (tmp_path / "bare").mkdir()
    one_line_error(lambda: check_available(f"segfolder:{tmp_path / 'bare'}"), "has no images/ folder")
    (tmp_path / "empty" / "images").mkdir(parents=True)
    (tmp_path / "empty" / "masks").mkdir()
    one_line_error(lambda: check_available(f"segfolder:{tmp_path / 'empty'}"), "holds no .jpg, .jpeg, .png images")
    root = write_segfolder(tmp_path / "seg", names)
    check_available(f"segfolder:{root}")
    (root / "masks" / f"{Path(names[1]).stem}.png").unlink()
    one_line_error(lambda: check_available(f"segfolder:{root}"), f"image {names[1]} of {root} has no mask")
    one_line_error(lambda: read_segfolder(f"imagefolder:{root}", "test", (1, 3, 8, 8), 1), "give --eval segfolder:DIR")


def test_masks_that_are_not_class_indices_of_their_image_are_refused(tmp_path):
    splits = split_counts(train=2, val=1, test=1)
    root = write_segfolder(tmp_path / "seg", sum(splits.values(), []))
    mask = root / "masks" / f"{Path(splits['test'][0]).stem}.png"
    Image.new("RGB", (16, 12)).save(mask)
    one_line_error(lambda: read_segfolder(f"segfolder:{root}", "test", (1, 3, 12, 16), 1), "is a RGB image")
    Image.new("L", (15, 12)).save(mask)
    one_line_error(lambda: read_segfolder(f"segfolder:{root}", "test", (1, 3, 12, 16), 1), "but its image is 16×12")
    (root / "images" / splits["test"][0]).write_bytes(b"not an image")
    one_line_error(lambda: read_segfolder(f"segfolder:{root}", "test", (1, 3, 12, 16), 1), "cannot read image")


# --- COCO folders -----------------------------------------------------------------------------------------------

def test_coco_images_are_letterboxed_into_the_input_size_with_their_boxes_scaled(tmp_path):
    splits = split_counts(train=1, val=1, test=2)
    test_a, test_b = splits["test"]
    root = write_coco(tmp_path / "coco", {
        splits["train"][0]: ((20, 20), [(0, 0, 5, 5, 1)]),
        splits["val"][0]: ((20, 20), [(0, 0, 5, 5, 1)]),
        test_a: ((64, 48), [(8, 4, 20, 10, 2), (0, 0, 64, 48, 1), (1, 1, 2, 2, 3), (5, 5, 0, 3, 1)]),
        test_b: ((30, 60), []),
    })
    data = json.loads((root / "annotations.json").read_text())
    data["annotations"][-2]["iscrowd"] = 1
    (root / "annotations.json").write_text(json.dumps(data))
    images, targets = read_coco(f"coco:{root}", "test", (1, 3, 32, 32), samples=5)
    assert images.shape == (2, 3, 32, 32)
    first, second = sorted([test_a, test_b]).index(test_a), sorted([test_a, test_b]).index(test_b)
    # 64×48 fits 32×32 at scale 1/2: 32×24, the 8 rows below are padding.
    assert torch.equal(targets[first]["boxes"], torch.tensor([[4.0, 2.0, 14.0, 7.0], [0.0, 0.0, 32.0, 24.0]]))
    assert targets[first]["labels"].tolist() == [2, 1]  # the crowd box and the box without width are left out
    red = 10 * (list(data["images"][i]["file_name"] for i in range(4)).index(test_a) + 1) / 255
    assert torch.allclose(images[first, 0, :24], torch.full((24, 32), red), atol=1e-6)
    assert not images[first, :, 24:].any() and not images[first, 1:].any()
    # 30×60 fits at scale 32/60: 16 columns wide, no box, still an image to score (false positives count).
    assert not images[second, :, :, 16:].any() and images[second, 0, :, :16].all()
    assert targets[second]["boxes"].shape == (0, 4) and targets[second]["labels"].shape == (0,)


def test_coco_images_may_sit_beside_the_json(tmp_path):
    names = sum(split_counts(train=1, val=1, test=1).values(), [])
    root = write_coco(tmp_path / "coco", {name: ((8, 8), [(1, 1, 4, 4, 1)]) for name in names}, image_dir="")
    check_available(f"coco:{root}")
    assert read_coco(f"coco:{root}", "test", (1, 3, 8, 8), 1)[1][0]["boxes"].tolist() == [[1.0, 1.0, 5.0, 5.0]]


def _broken(tmp_path: Path, name: str, change) -> str:
    names = sum(split_counts(train=1, val=1, test=1).values(), [])
    root = write_coco(tmp_path / name, {n: ((8, 8), [(1, 1, 4, 4, 1)]) for n in names})
    path = root / "annotations.json"
    data = json.loads(path.read_text())
    text = change(data)
    path.write_text(text if isinstance(text, str) else json.dumps(data))
    return f"coco:{root}"


@pytest.mark.parametrize(("change", "fragment"), [
    (lambda d: "{not json", "is not valid JSON"),
    (lambda d: d.pop("images") and None, '"images" and "annotations" lists'),
    (lambda d: d["images"][0].pop("height") and None, "needs a file_name, an integer id and a positive width"),
    (lambda d: d["images"][1].update(id=d["images"][0]["id"]), "appears twice"),
    (lambda d: d["annotations"][0].update(image_id=7), "belongs to no image"),
    (lambda d: d["annotations"][0].update(bbox=[1, 1, -2, 4]), "a width and height of 0 or more"),
    (lambda d: d["annotations"][0].update(bbox=[1, 1, 4]), "a COCO box is [x, y, width, height]"),
    (lambda d: d["annotations"][0].update(category_id=0), "categories are integers from 1"),
    (lambda d: d["images"][0].update(file_name="gone.png"), "image gone.png of"),
])
def test_bad_coco_folders_are_one_line_errors(tmp_path, change, fragment):
    one_line_error(lambda: check_available(_broken(tmp_path, "coco", change)), fragment)


def test_missing_coco_folders_and_other_specs_are_refused(tmp_path):
    one_line_error(lambda: check_available(f"coco:{tmp_path / 'missing'}"), "COCO folder")
    (tmp_path / "bare").mkdir()
    one_line_error(lambda: check_available(f"coco:{tmp_path / 'bare'}"), "has no annotations.json")
    one_line_error(lambda: read_coco(f"segfolder:{tmp_path}", "test", (1, 3, 8, 8), 1), "give --eval coco:DIR")


def test_an_image_of_another_size_than_its_entry_is_refused(tmp_path):
    spec = _broken(tmp_path, "coco", lambda d: None)
    root = Path(spec.partition(":")[2])
    test_name = names_in("test", 1)[0]
    Image.fromarray(np.zeros((9, 8, 3), dtype=np.uint8)).save(root / "images" / test_name)
    one_line_error(lambda: read_coco(spec, "test", (1, 3, 8, 8), 1), "is 8×9 but annotations.json gives 8×8")
