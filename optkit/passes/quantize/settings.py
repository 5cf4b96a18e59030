"""The INT8 settings, declared once: validation, recipe keys, CLI options and docs all read them from here."""

from __future__ import annotations

from dataclasses import dataclass

from optkit.core.settings import Settings, args_section, calib_data_setting, setting

MODES = ("static", "dynamic")
CALIBRATION_METHODS = ("minmax", "entropy", "percentile")


def check_calibration_source(settings: Settings) -> None:
    """The rule every setting group with ``calib_data`` and ``random_calibration`` keeps: one source, not both.

    Raises:
        ValueError: naming both settings.
    """
    if settings.random_calibration and settings.calib_data is not None:
        raise ValueError("give either calib_data (--calib-data) or random_calibration (--random-calibration), "
                         "not both")


@dataclass(frozen=True)
class Int8Settings(Settings):
    """INT8 quantization of an exported ONNX model with ONNX Runtime (static QDQ or dynamic)."""

    mode: str = setting("static", help="static: weights and activations INT8, calibrated on data (CNNs); dynamic: "
                        "weights only, activations quantized at run time (models whose time is in linear layers, "
                        "e.g. ViT). Language models are always quantized dynamically.", choices=MODES,
                        flag="int8-mode")
    calibration_method: str = setting("minmax", help="How activation ranges are set from the calibration data "
                                      "(static mode).", choices=CALIBRATION_METHODS, flag="calibration-method")
    calib_data: str | None = calib_data_setting(help="Dataset spec whose images calibrate the activation ranges "
                                                "and check the INT8 model (fashion-mnist, imagefolder:DIR, ...); "
                                                "for a language model, text that checks its perplexity (text, "
                                                "text:FILE|DIR).")
    calibration_batches: int = setting(8, help="Batches of calibration images.", low=1, flag="calibration-batches")
    batch_size: int = setting(16, help="Images per calibration or checking batch (text blocks for a language "
                              "model).", low=1, flag="calib-batch-size")
    random_calibration: bool = setting(False, help="Calibrate and check on random inputs when no data is at hand "
                                       "(the INT8 model is then fit only for timing).", flag="random-calibration")
    eval_samples: int = setting(256, help="Images on which the INT8 model is checked against the FP32 one (for a "
                                "language model, text blocks of the sequence length, at most 8,192 tokens); an image "
                                "model that misses within two standard errors is checked again on four times as many "
                                "images, which decide.", low=1, flag="int8-eval-samples")
    min_agreement: float = setting(0.99, help="Smallest fraction of images whose top-1 class the INT8 model must "
                                   "share with the FP32 one (for a language model checked on random token ids: "
                                   "of token positions).", low=0, high=1, flag="min-agreement")
    max_accuracy_drop: float = setting(0.01, help="Largest accuracy loss allowed when the data has labels (0.01 is "
                                       "one point).", low=0, high=1, flag="max-accuracy-drop")
    max_perplexity_increase: float = setting(0.02, help="Language models: largest rise of the INT8 model's "
                                             "perplexity on the text over the FP32 model's (0.02: at most 1.02x).",
                                             low=0, flag="max-perplexity-increase")
    per_channel: bool = setting(True, help="One weight scale per output channel (per tensor when false).")
    op_types: tuple[str, ...] = setting((), help="ONNX op types to quantize (empty: every type ONNX Runtime "
                                        "quantizes).", flag="int8-op-types", metavar="TYPE,...")
    exclude: tuple[str, ...] = setting((), help="ONNX node names kept in FP32.", flag="int8-exclude",
                                       metavar="NODE,...")
    measure_ops: bool = setting(True, help="Time each quantized op group, then single nodes, on this machine and "
                                "keep in FP32 those whose INT8 kernels are slower (cached per machine).")
    timing_threads: int = setting(1, help="ONNX Runtime threads when timing op groups.", low=1,
                                  flag="int8-timing-threads")
    auto_exclude: bool = setting(True, help="When the INT8 model misses a threshold, keep the layers that hurt "
                                 "most in FP32, one at a time, worst first.")
    max_excluded: int = setting(5, help="Most layers the exclusion search keeps in FP32.", low=0,
                                flag="max-excluded")
    seed: int = setting(0, help="Seed of the random calibration inputs and of the checking images' order.", low=0,
                        flag="int8-seed")

    def check(self) -> None:
        """Rules that involve several settings.

        Raises:
            ValueError: naming the settings that conflict.
        """
        check_calibration_source(self)
        if self.mode == "dynamic" and self.calibration_method != "minmax":
            raise ValueError("calibration_method applies to static mode only; dynamic mode has no calibration")


Int8Settings.__doc__ += "\n\n" + args_section(Int8Settings)
