"""Recipes as optkit wrote them before recipes carried a version (version 1), byte for byte.

``WITH_INT8`` is what ``optkit optimize --prune 0.3 --round-to 8 --finetune fashion-mnist --epochs 1
--export onnx --int8 --calib-data fashion-mnist --min-agreement 0.98`` saved into ``model.pt`` and
``recipe.toml``; ``DEMO`` is the recipe in ``optkit/demo/fashion_resnet.pt``.
"""

DEMO = "input_shape = [1, 1, 28, 28]\n"

WITH_INT8 = '''input_shape = [1, 1, 28, 28]

[int8]
mode = "static"
calibration_method = "minmax"
calib_data = "fashion-mnist"
calibration_batches = 8
batch_size = 16
random_calibration = false
eval_samples = 256
min_agreement = 0.98
max_accuracy_drop = 0.01
per_channel = true
op_types = []
exclude = []
measure_ops = true
timing_threads = 1
auto_exclude = true
max_excluded = 5
seed = 0

[[pass]]
name = "structured_prune"
ratio = 0.3
round_to = 8
importance = "l1"
allocation = "uniform"
iterative_steps = 1
ignored_layers = []
latency_batch = 1
target_tolerance = 0.01
timeout_s = 120.0
group_timeout_s = 5.0
fallback_budget_s = 40.0
fallback_trials = 40
bias_correction = true
calibration_batches = 4
batch_size = 16

[[pass]]
name = "finetune"
data = "fashion-mnist"
epochs = 1
batch_size = 128
lr = 0.001
weight_decay = 0.05
warmup = 0.05
grad_clip = 1.0
amp = "auto"
distill = false
temperature = 4.0
alpha = 0.5
seed = 0
checkpoint_every = 200
num_workers = "auto"
'''
