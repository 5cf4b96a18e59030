"""The deployment settings, declared once: the task check they share with INT8, OpenVINO's, and the choice's.

The task check's settings are the INT8 ones (:class:`optkit.passes.quantize.settings.Int8Settings`), taken
with their declarations, so ``--calib-data``, ``--min-agreement`` and the rest set every step that checks a
deployment on the task. Importing this module needs no torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from optkit.core.settings import Settings, args_section, declared, setting
from optkit.passes.quantize.settings import Int8Settings, check_calibration_source
from optkit.passes.quantize.weights import BLOCK_SIZES

PRECISIONS = ("fp32", "bf16", "int8")
RUNTIMES = ("onnxruntime", "openvino")
#: Every deployment the choice may try, simplest first: a later one is kept only when it is faster than
#: every earlier one that passed its checks (lower precision, or the extra runtime, must pay for itself).
CANDIDATES = ("onnxruntime-fp32", "openvino-fp32", "openvino-bf16", "onnxruntime-int8", "openvino-int8")
#: The same for a language model (token ids and a mask; its decode graph deployed with it), checked by
#: perplexity: ``w8``/``w4`` are weight-only INT8/INT4 (ONNX Runtime's MatMulNBits, NNCF's weight compression),
#: ``onnxruntime-int8`` dynamic INT8. OpenVINO INT8 of a language model is its weight compression.
TOKEN_CANDIDATES = ("onnxruntime-fp32", "openvino-fp32", "openvino-bf16", "onnxruntime-int8", "onnxruntime-w8",
                    "openvino-w8", "onnxruntime-w4", "openvino-w4")
ALL_CANDIDATES = tuple(dict.fromkeys(CANDIDATES + TOKEN_CANDIDATES))
INT4_SCHEMES = ("sym", "asym")


def _as_int8(name: str, **changes) -> dataclasses.Field:
    """The field ``name`` as :class:`Int8Settings` declares it (``changes`` replace parts of its declaration)."""
    source = next(f for f in dataclasses.fields(Int8Settings) if f.name == name)
    spec = declared(source)
    words = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.name != "accepts"}
    return setting(source.default, **{**words, **changes})


def check_candidates(value) -> tuple[str, ...]:
    """Validate a list of deployments (``()``: all of :data:`CANDIDATES`, or :data:`TOKEN_CANDIDATES` for a
    language model), keeping their order of simplicity.

    Raises:
        ValueError: naming the valid names.
    """
    names = tuple(v.strip() for v in value.split(",")) if isinstance(value, str) else tuple(value)
    unknown = [name for name in names if name not in ALL_CANDIDATES]
    if unknown or isinstance(value, (bytes, dict)):
        raise ValueError(f"deployment candidates must be names among {', '.join(ALL_CANDIDATES)}; got {value!r}")
    return tuple(name for name in ALL_CANDIDATES if name in names)


def check_block_size(value) -> int:
    """Validate a weight-only INT4 block size (one of :data:`BLOCK_SIZES`).

    Raises:
        ValueError: naming the valid sizes.
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)) or str(value).strip() not in map(str, BLOCK_SIZES):
        raise ValueError(f"the weight block size must be one of {', '.join(map(str, BLOCK_SIZES))}; got {value!r}")
    return int(value)


@dataclass(frozen=True)
class CheckSettings(Settings):
    """How a deployment is checked on the task against the FP32 model (the INT8 settings of the same names)."""

    calib_data: str | None = _as_int8("calib_data", help="Dataset spec whose images calibrate INT8 models and "
                                      "check lower-precision ones (bf16, INT8) against FP32 (fashion-mnist, "
                                      "imagefolder:DIR, ...).")
    calibration_batches: int = _as_int8("calibration_batches")
    batch_size: int = _as_int8("batch_size")
    random_calibration: bool = _as_int8("random_calibration")
    eval_samples: int = _as_int8("eval_samples", help="Images on which a lower-precision model (INT8, bf16) is "
                                 "checked against the FP32 one (a miss within two standard errors is checked again "
                                 "on four times as many, which decide).")
    min_agreement: float = _as_int8("min_agreement", help="Smallest fraction of images whose top-1 class a "
                                    "lower-precision model (INT8, bf16) must share with the FP32 one.")
    max_accuracy_drop: float = _as_int8("max_accuracy_drop")
    seed: int = _as_int8("seed")

    def check(self) -> None:
        """Rules that involve several settings (those of INT8's calibration).

        Raises:
            ValueError: naming the settings that conflict.
        """
        check_calibration_source(self)

    def int8_settings(self, **changes) -> Int8Settings:
        """The INT8 settings of ONNX Runtime's quantization with this check."""
        shared = {f.name: getattr(self, f.name) for f in dataclasses.fields(CheckSettings)}
        return Int8Settings(**{**shared, **changes})


@dataclass(frozen=True)
class OpenVinoSettings(CheckSettings):
    """An OpenVINO IR of the exported model at one precision, checked on the task."""

    precision: str = setting("fp32", help="Also write the model as OpenVINO IR (NAME.xml + NAME.bin) computing in "
                             "this precision: fp32, bf16 (CPUs with bf16 instructions) or int8 (NNCF; needs "
                             "--calib-data), checked on the task against the FP32 model.", choices=PRECISIONS,
                             flag="openvino", enables=True)


@dataclass(frozen=True)
class DeploySettings(CheckSettings):
    """The fastest deployment that passes its checks, timed on this machine against the unpruned FP32 model."""

    threads: int | None = setting(None, help="Threads the deployments are timed at, as you will run them "
                                  "(default: every core).", low=1, flag="deploy-threads")
    batch: int = setting(1, help="Batch size the deployments are timed at.", low=1, flag="deploy-batch")
    candidates: tuple[str, ...] = setting((), help="Deployments to try, among onnxruntime-fp32, openvino-fp32, "
                                          "openvino-bf16, onnxruntime-int8, openvino-int8; for a language model "
                                          "also the weight-only onnxruntime-w8, openvino-w8, onnxruntime-w4 and "
                                          "openvino-w4 (default: all that can run here).", check=check_candidates,
                                          flag="deploy-candidates", metavar="NAME,...")
    weight_block_size: int = setting(32, help="Language models: weights per scale of the weight-only INT4 "
                                     "deployments (ONNX Runtime's MatMulNBits block, NNCF's group size): 32, 64 or "
                                     "128; smaller keeps more accuracy, larger runs a little faster.",
                                     check=check_block_size, flag="weight-block-size", metavar="32|64|128")
    int4_scheme: str = setting("sym", help="Language models: weight-only INT4 symmetric (a scale per block) or "
                               "asymmetric (a scale and a zero point per block).", choices=INT4_SCHEMES,
                               flag="int4-scheme")
    min_gain: float = setting(0.02, help="A deployment is kept over a simpler one (higher precision, or ONNX "
                              "Runtime over OpenVINO) only when it measures at least this fraction faster.", low=0,
                              high=1, high_open=True, flag="deploy-min-gain")
    repeats: int = setting(20, help="Timed calls of each deployment, in alternating blocks of 2.", low=1,
                           flag="deploy-repeats")


CheckSettings.__doc__ += "\n\n" + args_section(CheckSettings)
OpenVinoSettings.__doc__ += "\n\n" + args_section(OpenVinoSettings)
DeploySettings.__doc__ += "\n\n" + args_section(DeploySettings)
