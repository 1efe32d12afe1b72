"""The settings' enumerations, declared once, and the base every section is built on."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict

# The settings' enumerations, declared once: the settings' types, the CLI's choices, the admin API's per-load
# overrides and the backends' checks all read them from here.
Backend = Literal["torch", "onnx", "openvino", "auto"]
Dtype = Literal["auto", "float32", "float16", "bfloat16", "mixed"]
Quantize = Literal["none", "int8-weights", "int8"]
LoadMode = Literal["background", "eager", "lazy"]
LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]
LogFormat = Literal["json", "text"]
Docs = Literal["public", "keys", "off"]
Platform = Literal["sagemaker", "vertex"]
# backend auto's candidates, fastest first (core/backends/auto.py ALL, which a test holds to this list): a name
# outside it is refused with the settings, not lost in the background judging at start.
AutoCandidate = Literal["openvino-mixed", "openvino-bfloat16", "openvino-float32-int8", "openvino-float32",
                        "torch-float16"]
BACKENDS: tuple[str, ...] = get_args(Backend)
DTYPES: tuple[str, ...] = get_args(Dtype)
QUANTIZE: tuple[str, ...] = get_args(Quantize)
LOAD_MODES: tuple[str, ...] = get_args(LoadMode)
LOG_LEVELS: tuple[str, ...] = get_args(LogLevel)
LOG_FORMATS: tuple[str, ...] = get_args(LogFormat)
PLATFORMS: tuple[str, ...] = get_args(Platform)
AUTO_CANDIDATES: tuple[str, ...] = get_args(AutoCandidate)
# model.unpadded is a bool or "auto" (YAML and the environment give booleans); the backends read it as text,
# one of these.
UNPADDED = ("auto", "true", "false")


class Section(BaseModel):
    """A settings section: unknown keys refused, frozen once built."""

    model_config = ConfigDict(extra="forbid", frozen=True)
