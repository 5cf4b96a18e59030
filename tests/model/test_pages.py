import sys

import numpy as np
import pytest
import torch
from torch import nn

from optkit.model.pages import evict_clean, file_storages, release

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="file pages are released on Linux only")

ROWS, COLS = 8192, 1024  # 32 MiB of fp32 per layer


def _resident_file_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssFile:"))


def _mapped_layer(path, offset: float) -> nn.Linear:
    (np.arange(ROWS * COLS, dtype=np.float32) + offset).tofile(path)
    layer = nn.Linear(COLS, ROWS, bias=False)
    mapped = torch.from_file(str(path), shared=False, size=ROWS * COLS, dtype=torch.float32).view(ROWS, COLS)
    layer.weight = nn.Parameter(mapped, requires_grad=False)
    return layer


def test_pages_of_replaced_weights_leave_the_resident_set_and_weights_still_read_stay(tmp_path):
    replaced, still_read = _mapped_layer(tmp_path / "a.bin", 0.0), _mapped_layer(tmp_path / "b.bin", 0.5)
    alias = still_read.weight.detach().view(-1)  # something else still reads the second layer's pages
    storages = file_storages(replaced) + file_storages(still_read)
    assert len(storages) == 2
    assert file_storages(nn.Linear(4, 4)) == []  # weights in ordinary memory are not file pages
    float(replaced.weight.sum()) + float(still_read.weight.sum())  # read every page
    resident = _resident_file_bytes()
    replaced.to(torch.float64)
    still_read.to(torch.float64)
    released = release(storages)
    assert ROWS * COLS * 4 - 2 * 4096 <= released <= ROWS * COLS * 4  # whole pages of the replaced weight only
    assert resident - _resident_file_bytes() >= 0.9 * released
    assert len(storages) == 1 and storages[0].data_ptr() == alias.data_ptr()  # kept to try again later
    expected = np.arange(ROWS * COLS, dtype=np.float32) + 0.5
    np.testing.assert_array_equal(alias.numpy(), expected)  # the pages still read are intact
    np.testing.assert_array_equal(replaced.weight.numpy().ravel(), expected - 0.5)  # the copy is the weights


def test_clean_file_pages_are_evicted_and_pages_written_since_loading_are_kept(tmp_path):
    layer = _mapped_layer(tmp_path / "a.bin", 0.0)
    float(layer.weight.sum())
    with torch.no_grad():
        layer.weight[: ROWS // 4] += 1  # a quarter written after loading: those pages are private copies now
    resident = _resident_file_bytes()
    dropped = evict_clean(layer)
    assert 0.74 * ROWS * COLS * 4 <= dropped <= 0.75 * ROWS * COLS * 4  # the three clean quarters
    assert resident - _resident_file_bytes() >= 0.9 * dropped
    expected = np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS)
    expected[: ROWS // 4] += 1
    np.testing.assert_array_equal(layer.weight.numpy(), expected)  # read back from the file, the write kept
