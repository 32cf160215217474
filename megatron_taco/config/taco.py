"""TACO flags -> one validated config object that answers "how is this linear's traffic compressed?".

Every ``--taco-*`` flag is checked at start-up; an invalid value raises
:class:`TacoConfigError` naming the flag and the value.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Dict, FrozenSet, Optional, Sequence, Tuple

from megatron_taco.codec.format import ELEMENT_FORMATS, FP8_FORMATS, GROUP_SIZES, SCALE_MODES
from megatron_taco.codec.taco import BACKENDS
from megatron_taco.codec.te_cast import TE_GROUP_SIZE, te_unavailable_reason
from megatron_taco.config.errors import TacoConfigError

__all__ = [
    "MODES",
    "LINEARS",
    "DIRECTIONS",
    "LinearSettings",
    "TacoConfig",
    "add_taco_args",
    "check_backend_runs_here",
    "check_switch_before_end",
    "taco_config_from_args",
]

# mode = element family, and "-ash" for the Adaptive Scale-Hadamard transform before quantizing
MODES = ("none", "fp8", "fp8-ash", "int8", "int8-ash", "fp4", "fp4-ash", "int4", "int4-ash")
_MODE_FORMATS = {"int8": "int8", "fp4": "e2m1", "int4": "int4"}  # the element format of the non-FP8 families
LINEARS = ("qkv", "proj", "fc1", "fc2")
DIRECTIONS = ("fwd", "bwd", "both")
# the codec's own vocabulary (one definition): backends, scale storage, FP8 formats, group sizes
SCALES = tuple(SCALE_MODES)
FORMATS = tuple(FP8_FORMATS)
_SIZE_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
LAST = -1  # 'last' in a layer range, until the model's layer count is known (TacoConfig.for_model)


@dataclasses.dataclass(frozen=True)
class LinearSettings:
    """Compression of one linear's TP traffic (what a layer range resolves to)."""

    mode: str = "none"
    linears: FrozenSet[str] = frozenset(LINEARS)
    direction: str = "both"
    group_size: int = 128
    fmt: str = "e4m3"  # the FP8 format of the fp8 modes (--taco-fp8-format)
    scales: str = "fp32"
    bwd_mode: Optional[str] = None  # the gradient traffic's mode (None: the same as ``mode``)
    stochastic_bwd: bool = False  # the gradient traffic's 4-bit codes rounded stochastically (unbiased)

    def mode_for(self, direction: str) -> str:
        """The mode of the forward ("fwd") or the gradient ("bwd") traffic."""
        return self.bwd_mode if direction == "bwd" and self.bwd_mode is not None else self.mode

    @property
    def enabled(self) -> bool:
        return any(self.mode_for(d) != "none" for d in ("fwd", "bwd"))

    def compresses(self, linear: str, direction: str) -> bool:
        return self.mode_for(direction) != "none" and linear in self.linears and self.direction in (direction, "both")

    def transform_for(self, direction: str) -> str:
        return "ash" if self.mode_for(direction).endswith("-ash") else "none"

    def element_format_for(self, direction: str) -> str:
        """What an element travels as: the FP8 format of the fp8 modes, INT8 for int8, E2M1 for fp4, INT4 for int4."""
        mode = self.mode_for(direction)
        return _MODE_FORMATS.get(mode.split("-")[0], self.fmt)

    def rounding_for(self, direction: str) -> str:
        return "stochastic" if direction == "bwd" and self.stochastic_bwd else "nearest"

    def describe_modes(self) -> str:
        """'fp8-ash', or 'fp4-ash (backward fp8-ash)' when the gradient traffic has its own mode."""
        backward = self.mode_for("bwd") + (", stochastic rounding" if self.stochastic_bwd else "")
        return self.mode if backward == self.mode else f"{self.mode} (backward {backward})"


@dataclasses.dataclass(frozen=True)
class TacoConfig:
    """All TACO settings of a run. ``layers``: ranges of 1-based global layer numbers (None = all)."""

    default: LinearSettings = LinearSettings()
    layers: Optional[Tuple[Tuple[int, int], ...]] = None
    overrides: Tuple[Tuple[Tuple[Tuple[int, int], ...], LinearSettings], ...] = ()
    min_bytes: Optional[int] = None  # None: measure the link (comm.policy.auto_options)
    chunk_bytes: int = 128 << 20
    backend: str = "auto"
    log_interval: int = 10
    error_sample_interval: int = 10
    # --taco-switch: (ITER, the settings from iteration ITER + 1 on), e.g. INT4 early and FP8 for the last steps
    switch: Optional[Tuple[int, "TacoConfig"]] = None

    @property
    def enabled(self) -> bool:
        return (
            self.default.enabled
            or any(s.enabled for _, s in self.overrides)
            or (self.switch is not None and self.switch[1].enabled)
        )

    def describe_switch(self) -> str:
        """'' or, with --taco-switch, e.g. '; after iteration 800: fp8-ash'."""
        if self.switch is None:
            return ""
        iteration, then = self.switch
        return f"; after iteration {iteration}: {then.default.describe_modes()}" + (
            " and its overrides" if then.overrides else ""
        )

    def for_layer(self, layer_number: int) -> LinearSettings:
        """Settings of a 1-based global layer: the last matching override, else the default if selected."""
        if any(LAST in bounds for ranges in [self.layers or ()] + [r for r, _ in self.overrides] for bounds in ranges):
            raise ValueError(
                "a layer range names 'last' (an override over 'all' does too): resolve it with "
                "TacoConfig.for_model(num_layers) first"
            )
        for ranges, settings in reversed(self.overrides):
            if _in_ranges(layer_number, ranges):
                return settings
        if self.layers is None or _in_ranges(layer_number, self.layers):
            return self.default
        return dataclasses.replace(self.default, mode="none", bwd_mode=None)

    def for_model(self, num_layers: int) -> "TacoConfig":
        """This config for a model of ``num_layers`` layers: 'last' becomes its number; fails when a layer range
        names layers the model does not have."""

        def resolve(flag: str, ranges: Tuple[Tuple[int, int], ...]) -> Tuple[Tuple[int, int], ...]:
            resolved = tuple(tuple(num_layers if n == LAST else n for n in bounds) for bounds in ranges)
            for (start, end), written in zip(resolved, ranges):
                text = "-".join(dict.fromkeys("last" if n == LAST else str(n) for n in written))
                if end > num_layers:
                    raise TacoConfigError(f"{flag}: layer range {text} exceeds the model's {num_layers} layers")
                if start > end:
                    raise TacoConfigError(f"{flag}: layer range {text} is empty in a model of {num_layers} layers")
            return resolved

        return dataclasses.replace(
            self,
            layers=None if self.layers is None else resolve("--taco-layers", self.layers),
            overrides=tuple((resolve("--taco-override", r), settings) for r, settings in self.overrides),
            switch=None if self.switch is None else (self.switch[0], self.switch[1].for_model(num_layers)),
        )


def _in_ranges(layer: int, ranges: Sequence[Tuple[int, int]]) -> bool:
    return any(start <= layer <= end for start, end in ranges)


def parse_layer_ranges(text: str, flag: str) -> Optional[Tuple[Tuple[int, int], ...]]:
    """'all' -> None; '1-4,9,11-12' -> ((1, 4), (9, 9), (11, 12)). Layers are 1-based; 'last' is the model's last
    layer (``LAST`` until :meth:`TacoConfig.for_model` knows the model), e.g. '1,last' or '5-last'."""
    text = text.strip()
    if text == "all":
        return None
    ranges = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+|last)\s*(?:-\s*(\d+|last))?\s*", part)
        if not match:
            raise TacoConfigError(
                f"{flag}: invalid layer range {part!r} in {text!r} (use e.g. 'all', '1-4,9-12' or '1,last')"
            )
        start, end = (LAST if n == "last" else int(n) for n in (match.group(1), match.group(2) or match.group(1)))
        if 0 in (start, end) or (LAST not in (start, end) and end < start) or start == LAST != end:
            raise TacoConfigError(
                f"{flag}: invalid layer range {part.strip()!r}: layers are 1-based, start <= end, and 'last' can only "
                "end a range"
            )
        ranges.append((start, end))
    return tuple(ranges)


def parse_bytes(text: str, flag: str) -> int:
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:i?B)?\s*", str(text), flags=re.IGNORECASE)
    if not match:
        raise TacoConfigError(f"{flag}: invalid size {text!r} (use bytes, or a number with K, M or G)")
    return int(match.group(1)) * _SIZE_SUFFIX[match.group(2).upper()]


def _choice(value, choices, flag: str):
    if value not in choices:
        raise TacoConfigError(f"{flag}: invalid value {value!r}; choose from {', '.join(map(str, choices))}")
    return value


def _parse_linears(text: str, flag: str) -> FrozenSet[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise TacoConfigError(f"{flag}: empty list of linears; choose from {', '.join(LINEARS)}")
    for name in names:
        _choice(name, LINEARS, flag)
    return frozenset(names)


_OVERRIDE_KEYS = {
    "mode": lambda v, f: _choice(v, MODES, f),
    "bwd_mode": lambda v, f: _choice(v, MODES, f),
    "linears": lambda v, f: _parse_linears(v.replace("+", ","), f),
    "direction": lambda v, f: _choice(v, DIRECTIONS, f),
    "group_size": lambda v, f: _choice(int(v) if v.isdigit() else v, GROUP_SIZES, f),
    "fmt": lambda v, f: _choice(v, FORMATS, f),
    "scales": lambda v, f: _choice(v, SCALES, f),
}


def _parse_override(text: str, base: LinearSettings) -> Tuple[Tuple[Tuple[int, int], ...], LinearSettings]:
    """'9-12:mode=none' or '1-2:group_size=64,fmt=e5m2' (linears joined with '+': 'linears=fc1+fc2')."""
    flag = "--taco-override"
    if ":" not in text:
        raise TacoConfigError(f"{flag}: invalid value {text!r}; use RANGES:key=value[,key=value] e.g. '1-2:mode=none'")
    range_text, settings_text = text.split(":", 1)
    ranges = parse_layer_ranges(range_text, flag) or ((1, LAST),)
    return ranges, _changed_settings(settings_text, base, flag, text)


def _changed_settings(settings_text: str, base: LinearSettings, flag: str, text: str) -> LinearSettings:
    """``base`` with the 'key=value,...' of ``settings_text`` (a value of ``flag``: ``text``), checked."""
    changes: Dict[str, object] = {}
    for item in settings_text.split(","):
        if "=" not in item:
            raise TacoConfigError(f"{flag}: invalid setting {item!r} in {text!r}; use key=value")
        key, value = (s.strip() for s in item.split("=", 1))
        if key not in _OVERRIDE_KEYS:
            raise TacoConfigError(f"{flag}: unknown key {key!r} in {text!r}; keys: {', '.join(_OVERRIDE_KEYS)}")
        changes[key] = _OVERRIDE_KEYS[key](value, f"{flag} {key}")
    settings = dataclasses.replace(base, **changes)
    _check_combinations(settings, f" (in {flag} {text!r})")
    return settings


def _parse_switch(text: str, base: LinearSettings) -> Tuple[int, LinearSettings]:
    """'800:mode=fp8-ash' -> (800, the flags' settings with those keys): what every layer's flags become after
    iteration 800 (the overrides then start from them)."""
    flag = "--taco-switch"
    iteration_text, _, settings_text = text.partition(":")
    if not settings_text:
        raise TacoConfigError(f"{flag}: invalid value {text!r}; use ITER:key=value[,key=value] e.g. '800:mode=fp8-ash'")
    return _positive_int(iteration_text.strip(), flag, 1), _changed_settings(settings_text, base, flag, text)


def add_taco_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The --taco-* flags; usable as (part of) a Megatron-LM ``extra_args_provider``."""
    group = parser.add_argument_group("TACO: compressed tensor-parallel communication")
    group.add_argument(
        "--taco-mode",
        default="none",
        help="none | fp8 (per-group FP8) | fp8-ash (Adaptive Scale-Hadamard + FP8) | int8, int8-ash (INT8 "
        "-127..127, the same bytes as FP8) | fp4, fp4-ash (FP4 E2M1, 4 bits per value) | int4, int4-ash (INT4 -7..7). "
        "Default: none",
    )
    group.add_argument(
        "--taco-bwd-mode",
        default=None,
        help="the gradient traffic's mode, one of the --taco-mode values (default: the same as --taco-mode); "
        "e.g. --taco-mode fp4-ash --taco-bwd-mode fp8-ash",
    )
    group.add_argument(
        "--taco-stochastic-rounding",
        action="store_true",
        help="round the gradient traffic's 4-bit codes stochastically (unbiased; needs a 4-bit --taco-bwd-mode "
        "or --taco-mode)",
    )
    group.add_argument(
        "--taco-layers",
        default="all",
        help="layers to compress: 'all' or ranges like '1-4,9-12' or '1,last' ('last': the model's last layer)",
    )
    group.add_argument(
        "--taco-linears",
        default="qkv,proj,fc1,fc2",
        help="which linears' traffic: any of qkv, proj, fc1, fc2 (comma-separated)",
    )
    group.add_argument("--taco-direction", default="both", help="fwd | bwd | both (backward = gradient traffic)")
    group.add_argument("--taco-group-size", default="128", help="elements per scale group: 32, 64, 128 or 256")
    group.add_argument("--taco-fp8-format", default="e4m3", help="e4m3 (default) or e5m2")
    group.add_argument("--taco-scales", default="fp32", help="fp32 (one folded scale), dual (paper), e8m0")
    group.add_argument(
        "--taco-override",
        action="append",
        default=[],
        help="per-range settings, repeatable: 'RANGES:key=value,...' (RANGES as --taco-layers), keys mode, linears, "
        "direction, group_size, fmt, scales, bwd_mode; e.g. '1-2:mode=none' or '1,last:mode=fp8-ash'",
    )
    group.add_argument(
        "--taco-switch",
        default=None,
        help="'ITER:key=value,...': after iteration ITER the flags take these settings (keys as --taco-override; "
        "the overrides then start from them), e.g. --taco-mode int4-ash --taco-bwd-mode fp8-ash "
        "--taco-switch 800:mode=fp8-ash: INT4 forward traffic, then FP8 for the low-learning-rate end",
    )
    group.add_argument(
        "--taco-min-bytes",
        default="auto",
        help="messages below this many bytes go uncompressed; 'auto' measures the link once per "
        "group (off on NVLink-class links). Accepts K/M/G suffixes",
    )
    group.add_argument("--taco-chunk-bytes", default="128M", help="pipelining piece size for large messages (0: off)")
    group.add_argument(
        "--taco-backend",
        default="auto",
        help="auto (Triton kernels on GPU, torch elsewhere), torch (reference), triton (needs a GPU), te (Transformer "
        "Engine's FP8 block cast: FP8 modes, group 128, fp32 scales; Triton transforms and decodes; slower on H200)",
    )
    group.add_argument("--taco-log-interval", default="10", help="steps between telemetry log lines (0: off)")
    group.add_argument(
        "--taco-error-sample-interval",
        default="10",
        help="measure the codec's relative error on every Nth message per linear (0: never)",
    )
    return parser


def _positive_int(value, flag: str, minimum: int = 0) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise TacoConfigError(f"{flag}: invalid value {value!r}; expected an integer >= {minimum}") from None
    if number < minimum:
        raise TacoConfigError(f"{flag}: invalid value {value!r}; expected an integer >= {minimum}")
    return number


def check_backend_runs_here(backend: str) -> None:
    """``--taco-backend triton`` needs a GPU (or Triton's CPU interpreter, TRITON_INTERPRET=1, as the tests use);
    ``--taco-backend te`` needs a GPU and Transformer Engine."""
    import os

    import torch

    if backend == "triton" and not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        raise TacoConfigError(
            "--taco-backend triton: Triton's kernels need a GPU here (no CUDA device); use auto or "
            "torch, or TRITON_INTERPRET=1 for Triton's slow CPU interpreter"
        )
    if backend == "te":
        if not torch.cuda.is_available():
            raise TacoConfigError(
                "--taco-backend te: Transformer Engine's FP8 cast needs a GPU (no CUDA device here); use auto"
            )
        reason = te_unavailable_reason()
        if reason is not None:
            raise TacoConfigError(
                f"--taco-backend te needs Transformer Engine ({reason}); pip install -e '.[te]', or use auto"
            )


def _check_te_covers(settings: LinearSettings, context: str = "") -> None:
    """``--taco-backend te``: every compressed direction in TE's block quantizer's reach (FP8, group 128, fp32)."""
    for direction, flag in (("fwd", "--taco-mode"), ("bwd", "--taco-bwd-mode")):
        mode = settings.mode_for(direction)
        if mode == "none":
            continue
        if settings.element_format_for(direction) not in FORMATS:
            raise TacoConfigError(
                f"--taco-backend te casts to FP8 only (Transformer Engine's block quantizer), not {flag} {mode}; "
                f"use --taco-backend triton for the INT8 and 4-bit modes{context}"
            )
        if settings.group_size != TE_GROUP_SIZE or settings.scales != "fp32":
            raise TacoConfigError(
                f"--taco-backend te: Transformer Engine's block quantizer has {TE_GROUP_SIZE}-element groups with fp32 "
                f"scales, not --taco-group-size {settings.group_size} --taco-scales {settings.scales}; use "
                f"--taco-backend triton{context}"
            )


def _check_combinations(settings: LinearSettings, context: str = "") -> None:
    """Refuse mode / scale / rounding combinations no codec implements (``context``: where they came from)."""
    if settings.stochastic_bwd and ELEMENT_FORMATS[settings.element_format_for("bwd")].bits != 4:
        raise TacoConfigError(
            "--taco-stochastic-rounding needs a 4-bit gradient mode (fp4, fp4-ash, int4, int4-ash as --taco-mode or "
            f"--taco-bwd-mode); the gradient traffic's mode is {settings.mode_for('bwd')}{context}"
        )
    for direction, flag in (("fwd", "--taco-mode"), ("bwd", "--taco-bwd-mode")):
        mode, bits = settings.mode_for(direction), ELEMENT_FORMATS[settings.element_format_for(direction)].bits
        if settings.scales == "e4m3" and mode != "none" and bits != 4:
            raise TacoConfigError(
                f"--taco-scales e4m3 (E4M3 group scales times a message scale, NVFP4's layout) is for the 4-bit "
                f"modes, not {flag} {mode}; use fp32, dual or e8m0 with 8-bit codes{context}"
            )
        if settings.scales == "dual" and mode != "none" and settings.transform_for(direction) != "ash":
            raise TacoConfigError(
                f"--taco-scales dual stores the adaptive scale of the -ash modes, not {flag} {mode}; use fp32 or "
                f"e8m0{context}"
            )


def taco_config_from_args(args: argparse.Namespace) -> TacoConfig:
    """Validate the parsed --taco-* flags into a :class:`TacoConfig`."""
    default = LinearSettings(
        mode=_choice(args.taco_mode, MODES, "--taco-mode"),
        bwd_mode=None if args.taco_bwd_mode is None else _choice(args.taco_bwd_mode, MODES, "--taco-bwd-mode"),
        stochastic_bwd=bool(args.taco_stochastic_rounding),
        linears=_parse_linears(args.taco_linears, "--taco-linears"),
        direction=_choice(args.taco_direction, DIRECTIONS, "--taco-direction"),
        group_size=_choice(
            _positive_int(args.taco_group_size, "--taco-group-size", 1), GROUP_SIZES, "--taco-group-size"
        ),
        fmt=_choice(args.taco_fp8_format, FORMATS, "--taco-fp8-format"),
        scales=_choice(args.taco_scales, SCALES, "--taco-scales"),
    )
    _check_combinations(default)
    backend = _choice(args.taco_backend, BACKENDS, "--taco-backend")

    def overrides_from(flags: LinearSettings, switch_text: Optional[str] = None) -> Tuple:
        """The --taco-override settings over ``flags`` (the flags' own, or after --taco-switch), checked."""
        after = "" if switch_text is None else f", after --taco-switch {switch_text!r}"
        overrides = [_parse_override(text, flags) for text in args.taco_override]
        if backend == "te":
            _check_te_covers(flags, "" if switch_text is None else f" (in --taco-switch {switch_text!r})")
            for text, (_, settings) in zip(args.taco_override, overrides):
                _check_te_covers(settings, f" (in --taco-override {text!r}{after})")
        return tuple(overrides)

    min_bytes = (
        None if str(args.taco_min_bytes).strip() == "auto" else parse_bytes(args.taco_min_bytes, "--taco-min-bytes")
    )
    config = TacoConfig(
        default=default,
        layers=parse_layer_ranges(args.taco_layers, "--taco-layers"),
        overrides=overrides_from(default),
        min_bytes=min_bytes,
        chunk_bytes=parse_bytes(args.taco_chunk_bytes, "--taco-chunk-bytes"),
        backend=backend,
        log_interval=_positive_int(args.taco_log_interval, "--taco-log-interval"),
        error_sample_interval=_positive_int(args.taco_error_sample_interval, "--taco-error-sample-interval"),
    )
    switch_text = getattr(args, "taco_switch", None)
    if switch_text is not None:
        iteration, switched = _parse_switch(switch_text, default)
        then = dataclasses.replace(config, default=switched, overrides=overrides_from(switched, switch_text))
        config = dataclasses.replace(config, switch=(iteration, then))
    _check_fp8_format_is_used(config, default.fmt)
    return config


def _check_fp8_format_is_used(config: TacoConfig, fmt: str) -> None:
    """Refuse --taco-fp8-format other than the default where no traffic uses an FP8 mode (it would do nothing)."""
    if fmt == LinearSettings.fmt:
        return
    configs = [config] + ([config.switch[1]] if config.switch is not None else [])
    settings = [s for c in configs for s in [c.default] + [o for _, o in c.overrides]]
    if not any(s.mode_for(d).startswith("fp8") for s in settings for d in ("fwd", "bwd")):
        raise TacoConfigError(
            f"--taco-fp8-format {fmt} sets the element format of the fp8 / fp8-ash modes, and no traffic here uses "
            f"one (--taco-mode {config.default.mode}); drop it, or choose an fp8 mode"
        )


def check_switch_before_end(config: TacoConfig, train_iters: Optional[int]) -> None:
    """--taco-switch ITER must come before the run's last iteration (``train_iters``; None: unknown)."""
    if config.switch is not None and train_iters is not None and config.switch[0] >= train_iters:
        raise TacoConfigError(
            f"--taco-switch: iteration {config.switch[0]} is not before the run's last (--train-iters {train_iters}); "
            "nothing would train with the switched settings"
        )
