import torch
from safetensors.torch import load_file, save_file

from optkit.io import hf


def test_tensors_read_one_at_a_time_equal_what_safetensors_loads(tmp_path):
    generator = torch.Generator().manual_seed(0)
    tensors = {"w.bf16": torch.randn(7, 5, generator=generator).to(torch.bfloat16),
               "w.f32": torch.randn(3, 2, 4, generator=generator), "ids": torch.arange(11, dtype=torch.int64) - 5,
               "mask": torch.tensor([True, False, True]), "empty": torch.zeros(0, 3), "scalar": torch.tensor(2.5)}
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    read = dict(hf._read_safetensors(path))
    expected = load_file(str(path))
    assert read.keys() == expected.keys() == tensors.keys()
    for key, tensor in expected.items():
        assert read[key].dtype == tensor.dtype and torch.equal(read[key], tensor), key
